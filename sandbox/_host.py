"""Host checks (bwrap, overlayfs, root, user namespaces, seccomp, init) and the static files commands see."""

from __future__ import annotations

import os
import shutil
import subprocess

from sandbox import _seccomp
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxUnavailable

__all__ = ["GRADER_NAME", "INIT_NAME", "check_host", "prepare_static_dir", "system_binds"]

GRADER_NAME = "grader.py"
INIT_NAME = "init"
_INSTALL_HINT = "run scripts/install_system_deps.sh as root (or: apt-get install -y bubblewrap tini libseccomp2)"
_INIT_CANDIDATES = ("tini-static", "tini")


def _find_bwrap(config: SandboxConfig) -> str:
    path = config.bwrap_path or shutil.which("bwrap")
    if path is None or not os.access(path, os.X_OK):
        raise SandboxUnavailable(
            f"bubblewrap ('bwrap') not found (looked for {config.bwrap_path or 'bwrap on PATH'}); "
            f"the sandbox needs it to isolate commands: {_INSTALL_HINT}"
        )
    return path


def _find_init() -> str:
    """tini: the sandbox's pid 1 (reaps orphans, passes on the command's exit status)."""
    for name in _INIT_CANDIDATES:
        path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if path is not None:
            return path
    raise SandboxUnavailable(
        f"no init for the sandbox's pid namespace (looked for {', '.join(_INIT_CANDIDATES)}): {_INSTALL_HINT}"
    )


def _filesystems() -> set[str]:
    try:
        with open("/proc/filesystems", encoding="utf-8") as f:
            return {line.split()[-1] for line in f if line.strip()}
    except OSError as e:
        raise SandboxUnavailable(f"cannot read /proc/filesystems ({e}); is /proc mounted?") from e


def _check_overlay() -> None:
    if "overlay" not in _filesystems():
        subprocess.run(["modprobe", "overlay"], capture_output=True, check=False)
    if "overlay" not in _filesystems():
        raise SandboxUnavailable(
            "the kernel has no overlayfs ('overlay' missing from /proc/filesystems); load it with "
            "'modprobe overlay' or use a kernel built with CONFIG_OVERLAY_FS"
        )


def check_host(config: SandboxConfig) -> str:
    """Verify the host can run sandboxes; return the bwrap path.

    Raises:
        SandboxUnavailable: naming what is missing and how to get it.
    """
    bwrap = _find_bwrap(config)
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            f"the sandbox mounts overlayfs and tmpfs workspaces on the host, which needs root "
            f"(CAP_SYS_ADMIN); running as uid {os.geteuid()}. Run the rollout/reward actors as root "
            "(as CI does) or inside a container where you are root"
        )
    _check_overlay()
    _find_init()
    seccomp_fd = _seccomp.filter_fd()  # also fails clearly now if libseccomp is missing
    # The probe binds what sandboxes bind (the system directories), never "/": a recursive bind of
    # "/" copies every host mount, neighbouring sandboxes' overlays included, and races with their
    # unmounting ("Can't bind mount ... No such file or directory").
    try:
        probe = subprocess.run(
            [
                bwrap,
                "--unshare-all",
                "--unshare-user",
                "--disable-userns",
                "--die-with-parent",
                "--seccomp",
                str(seccomp_fd),
                *_system_dir_binds(),
                "--",
                "/bin/true",
            ],
            capture_output=True,
            env={"PATH": "/usr/bin:/bin"},
            user=config.sandbox_uid,
            group=config.sandbox_gid,
            extra_groups=[],
            pass_fds=(seccomp_fd,),
            timeout=30,
            check=False,
        )
    finally:
        os.close(seccomp_fd)
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bwrap cannot create namespaces as uid {config.sandbox_uid} "
            f"(exit {probe.returncode}: {probe.stderr.decode(errors='replace').strip()}); enable "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 or "
            "user.max_user_namespaces>0; on Ubuntu 24.04+ also "
            "kernel.apparmor_restrict_unprivileged_userns=0), and bubblewrap >= 0.8 for --disable-userns"
        )
    return bwrap


_PASSWD = "root:x:0:0:root:/root:/bin/bash\nsandbox:x:{uid}:{gid}:sandbox:{home}:/bin/bash\n"
_GROUP = "root:x:0:\nsandbox:x:{gid}:\n"
_HOSTS = "127.0.0.1 localhost\n::1 localhost\n"
_NSSWITCH = "passwd: files\ngroup: files\nhosts: files\n"
_HOST_ETC_FILES = ("ld.so.cache", "localtime")
_HOST_ETC_DIRS = ("alternatives",)


def prepare_static_dir(store_dir: str, config: SandboxConfig) -> str:
    """Write the read-only /etc and grader every command sees; returns the directory."""
    static = os.path.join(store_dir, "S")
    etc = os.path.join(static, "etc")
    os.makedirs(etc, mode=0o755)
    os.chmod(static, 0o755)
    files = {
        "passwd": _PASSWD.format(uid=config.sandbox_uid, gid=config.sandbox_gid, home=config.workspace_dir),
        "group": _GROUP.format(gid=config.sandbox_gid),
        "hosts": _HOSTS,
        "nsswitch.conf": _NSSWITCH,
        "resolv.conf": "",
    }
    for name, text in files.items():
        with open(os.path.join(etc, name), "w", encoding="utf-8") as f:
            f.write(text)
    for name in _HOST_ETC_FILES:
        if os.path.isfile(os.path.join("/etc", name)):
            open(os.path.join(etc, name), "w").close()  # mount point for a read-only bind
    for name in _HOST_ETC_DIRS:
        if os.path.isdir(os.path.join("/etc", name)):
            os.mkdir(os.path.join(etc, name), 0o755)
    grader_src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grader.py")
    shutil.copyfile(grader_src, os.path.join(static, GRADER_NAME))
    os.chmod(etc, 0o755)
    for name in os.listdir(etc):
        path = os.path.join(etc, name)
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    os.chmod(os.path.join(static, GRADER_NAME), 0o644)
    # pid 1 executes a copy nobody in the sandbox may read: exec of an unreadable binary makes
    # the process non-dumpable, so the sandbox can neither ptrace its init nor read its memory.
    init = os.path.join(static, INIT_NAME)
    shutil.copyfile(_find_init(), init)
    os.chmod(init, 0o111)
    return static


def _system_dir_binds() -> list[str]:
    """bwrap arguments exposing /usr and the top-level bin/lib directories read-only (merged-/usr aware)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def system_binds(static_dir: str) -> list[str]:
    """bwrap arguments exposing the host's system directories read-only (merged-/usr aware)
    and the synthetic /etc with the few host /etc entries programs need."""
    args = [*_system_dir_binds(), "--ro-bind", os.path.join(static_dir, "etc"), "/etc"]
    for name in (*_HOST_ETC_FILES, *_HOST_ETC_DIRS):
        if os.path.exists(os.path.join(static_dir, "etc", name)):
            args += ["--ro-bind", os.path.join("/etc", name), os.path.join("/etc", name)]
    return args
