"""The positive control of the escape battery: a command in a bare ``bwrap`` as the sandbox ran it
before its hardening (every namespace unshared, same binds and uid, but no seccomp filter, no
``--disable-userns``, the caller's session keyring, bwrap's own dumpable init, a writable-looking
/proc/sys). An attack that works here and fails in an `Environment` is stopped by the hardening,
not by something the test forgot."""

from __future__ import annotations

import asyncio
import os

from sandbox._host import system_binds
from sandbox.layers import LayerStore


async def run_bare(store: LayerStore, cmd: str, timeout_s: float = 20.0) -> tuple[int, str, str]:
    cfg = store.config
    argv = [store.bwrap_path, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    argv += ["--setenv", "PATH", "/usr/bin:/bin"]
    argv += [*system_binds(store.static_dir), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--", cfg.shell, "-c", cmd]

    def drop() -> None:
        os.setgroups([])
        os.setgid(cfg.sandbox_gid)
        os.setuid(cfg.sandbox_uid)

    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
        preexec_fn=drop,
        start_new_session=True,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
