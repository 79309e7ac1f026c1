"""Sandbox latency benchmark: create, fork, snapshot and run("true"), side by side with the floor
(a bare ``bwrap ... true`` with the same namespaces and user) and with the naive approach of
copying the workspace for every fork. Prints one JSON line.

Every command runs as the product runs it: seccomp filter, ``--disable-userns``, fresh keyring,
tini as pid 1, host budgets on snapshots, and the environment's memory cgroup (``run_true``) or
none (``run_true_no_cgroup``). ``run_true`` is a command in an environment that already ran one
(the per-command cost); ``first_run_true`` is the first command of a fresh fork, which also waits
for the environment's one-time cgroup placement. ``bare_bwrap_hardened_true`` is bwrap alone with
the hardening flags (seccomp, --disable-userns, tini), to separate their cost from ours.

Usage (as root, bubblewrap installed):
    .venv/bin/python tests/bench/sandbox.py [--rounds N]      (or: python -m tests.bench.sandbox)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: this file's folder would shadow the `sandbox` package
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import structlog

from sandbox import Environment, LayerStore, SandboxConfig, _seccomp
from sandbox._host import INIT_NAME, system_binds
from sandbox._safepath import write_atomic

TREE = {f"pkg/mod{i:03d}.py": f"# module {i}\n" + "x = 1\n" * 300 for i in range(300)}  # ~600 KB


async def _bare_bwrap(store: LayerStore, *, hardened: bool = False) -> float:
    cfg = store.config
    argv = [store.bwrap_path, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    argv += [*system_binds(store.static_dir), "--proc", "/proc", "--dev", "/dev"]
    pass_fds: tuple[int, ...] = ()
    t0 = time.perf_counter()
    if hardened:
        pass_fds = (_seccomp.filter_fd(),)
        init = os.path.join(store.static_dir, INIT_NAME)
        argv += ["--unshare-user", "--disable-userns", "--as-pid-1", "--seccomp", str(pass_fds[0])]
        argv += ["--ro-bind", init, "/init", "--", "/init", "--"]
    else:
        argv += ["--"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "/bin/true",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"},
        user=cfg.sandbox_uid,
        group=cfg.sandbox_gid,
        extra_groups=[],
        pass_fds=pass_fds,
    )
    for fd in pass_fds:
        os.close(fd)
    await proc.wait()
    assert proc.returncode == 0
    return time.perf_counter() - t0


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


async def main(rounds: int) -> dict[str, object]:
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "create",
            "create_cached",
            "fork",
            "snapshot",
            "first_run_true",
            "run_true",
            "bare_bwrap_true",
            "bare_bwrap_hardened_true",
            "naive_copy_fork",
            "run_true_no_cgroup",
        )
    }
    plain = LayerStore(dataclasses.replace(SandboxConfig(), memory_cgroup=False))
    plain_env = Environment.create(plain, {})
    with LayerStore() as store:
        base = Environment.create(store, TREE)
        snap = base.snapshot()
        layer = snap.layers[0].path
        for _ in range(3):  # warm-up
            await base.run("true")
            await _bare_bwrap(store)
        for i in range(rounds):
            dt, env = _timed(lambda i=i: Environment.create(store, {**TREE, "unique.txt": f"{i}"}))
            samples["create"].append(dt)
            env.close()
            dt, env = _timed(lambda: Environment.create(store, TREE))
            samples["create_cached"].append(dt)
            env.close()
            dt, fork = _timed(lambda: Environment.fork(snap))
            samples["fork"].append(dt)
            write_atomic(
                fork.workspace_path, ("pkg", "mod000.py"), b"x = 2\n", uid=fork.uid, gid=fork.gid
            )
            dt, child = _timed(fork.snapshot)
            samples["snapshot"].append(dt)
            child.release()
            for key in ("first_run_true", "run_true"):
                t0 = time.perf_counter()
                result = await fork.run("true")
                samples[key].append(time.perf_counter() - t0)
                assert result.exit_code == 0
            fork.close()
            # alternate the order of the floor and the no-cgroup run, so drift in load hits both
            for step in ("bare", "hardened", "plain") if i % 2 else ("plain", "hardened", "bare"):
                if step == "bare":
                    samples["bare_bwrap_true"].append(await _bare_bwrap(store))
                elif step == "hardened":
                    samples["bare_bwrap_hardened_true"].append(await _bare_bwrap(store, hardened=True))
                else:
                    t0 = time.perf_counter()
                    await plain_env.run("true")
                    samples["run_true_no_cgroup"].append(time.perf_counter() - t0)
            target = os.path.join(store.dir, "naive-" + secrets.token_hex(4))
            dt, _ = _timed(lambda target=target: shutil.copytree(layer, target, symlinks=True))
            samples["naive_copy_fork"].append(dt)
            shutil.rmtree(target)
        snap.release()
        base.close()
    plain_env.close()
    plain.close()
    med = {f"{k}_ms": round(statistics.median(v) * 1000, 3) for k, v in samples.items()}
    return {
        "bench": "sandbox",
        "rounds": rounds,
        "tree_files": len(TREE),
        "tree_bytes": sum(len(v) for v in TREE.values()),
        **med,
        "memory_cgroup": store.cgroup is not None,
        "load_avg_1m": os.getloadavg()[0],
        "num_cpus": os.cpu_count(),
        "command_overhead_ratio": round(med["run_true_ms"] / med["bare_bwrap_true_ms"], 3),
        "first_command_overhead_ratio": round(med["first_run_true_ms"] / med["bare_bwrap_true_ms"], 3),
        "hardened_bwrap_ratio": round(med["bare_bwrap_hardened_true_ms"] / med["bare_bwrap_true_ms"], 3),
        "command_overhead_ratio_no_cgroup": round(med["run_true_no_cgroup_ms"] / med["bare_bwrap_true_ms"], 3),
        "naive_over_fork_ratio": round(med["naive_copy_fork_ms"] / med["fork_ms"], 1),
        "goal_fork_le_20ms": med["fork_ms"] <= 20.0,
        "goal_overhead_le_2x": med["run_true_ms"] <= 2 * med["bare_bwrap_true_ms"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    print(json.dumps(asyncio.run(main(parser.parse_args().rounds))))
