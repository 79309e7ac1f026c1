"""Typed, frozen configuration of the sandbox: per-command limits and the host set-up."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = ["SandboxConfig", "SandboxLimits"]

_MIB = 1024 * 1024


def _require_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}; pass a positive value")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every command run in an environment.

    Attributes:
        cpu_time_s: RLIMIT_CPU of each process (seconds of CPU time).
        memory_bytes: RLIMIT_AS of each process (virtual address space).
        total_memory_bytes: memory cgroup limit on all of an environment's processes together
            (and the tmpfs pages they write), when a memory cgroup is available on the host.
        file_size_bytes: RLIMIT_FSIZE: the largest file a process may write.
        num_processes: RLIMIT_NPROC, counted per environment (each command runs in its own
            user namespace, so environments do not share the count).
        num_open_files: RLIMIT_NOFILE.
        wall_time_s: default wall-clock timeout of a command; the whole process tree is killed.
        output_bytes: bytes of stdout and of stderr kept per command; the rest is discarded
            and the result is marked truncated.
        disk_bytes: size of the environment's private writable layer (tmpfs) including /tmp.
        num_inodes: files the writable layer may hold (and so a snapshot of it).
        max_dir_depth: directories a workspace may nest; a deeper tree fails its snapshot with
            `SandboxViolation` instead of reaching host code that walks it.
    """

    cpu_time_s: int = 30
    memory_bytes: int = 1024 * _MIB
    total_memory_bytes: int = 2048 * _MIB
    file_size_bytes: int = 64 * _MIB
    num_processes: int = 64
    num_open_files: int = 256
    wall_time_s: float = 30.0
    output_bytes: int = 64 * 1024
    disk_bytes: int = 256 * _MIB
    num_inodes: int = 32768
    max_dir_depth: int = 128

    def __post_init__(self) -> None:
        _require_positive(
            "SandboxLimits",
            cpu_time_s=self.cpu_time_s,
            memory_bytes=self.memory_bytes,
            total_memory_bytes=self.total_memory_bytes,
            file_size_bytes=self.file_size_bytes,
            num_processes=self.num_processes,
            num_open_files=self.num_open_files,
            wall_time_s=self.wall_time_s,
            output_bytes=self.output_bytes,
            disk_bytes=self.disk_bytes,
            num_inodes=self.num_inodes,
            max_dir_depth=self.max_dir_depth,
        )
        if self.max_dir_depth > 1024:
            raise ValueError(
                f"SandboxLimits.max_dir_depth={self.max_dir_depth} is above 1024; host walks hold one fd per "
                "level, lower it"
            )
        if self.total_memory_bytes < 64 * _MIB:
            raise ValueError(f"SandboxLimits.total_memory_bytes={self.total_memory_bytes} is below 64 MiB; raise it")
        if self.memory_bytes < 64 * _MIB:
            raise ValueError(
                f"SandboxLimits.memory_bytes={self.memory_bytes} is below 64 MiB; bash and python "
                "cannot start with less address space, raise it"
            )
        if self.num_processes < 4:
            raise ValueError(
                f"SandboxLimits.num_processes={self.num_processes} < 4; the sandbox's init, shell and "
                "command need at least 4, raise it"
            )

    def replace(self, **changes: float) -> SandboxLimits:
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SandboxConfig:
    """Host-side set-up shared by every environment of a `LayerStore`.

    Attributes:
        root_dir: directory holding layers and environment mounts; created with mode 0711.
            Must not contain ``:``, ``,`` or ``\\`` (they are separators in overlayfs options).
        sandbox_uid / sandbox_gid: the ids commands see themselves as inside the sandbox (and the
            host ids they run as where environments cannot have their own: ``env_uid_count=0``,
            or a kernel without idmapped mounts). Default: nobody/nogroup.
        env_uid_base / env_uid_count: the host uids (and gids, the same numbers) environments run
            as, one per live environment (`sandbox._ids`): the kernel counts inotify instances,
            fds in flight, message queues, pipe buffers, processes and keys per host uid, so no
            environment can exhaust another's. The default, 1879048192 (0x70000000) + 65536, lies
            above systemd's container range and below its foreign range, where no user is made; a
            store refuses a range holding a user, group or /etc/subuid|subgid range of the host.
            ``env_uid_count=0`` runs every environment as ``sandbox_uid`` (shared quotas).
        env_uid_quarantine_s: how long a closed environment's ids rest before another one gets
            them (the kernel frees some per-uid charges in deferred work after the processes).
        env_uid_claims: the file recording which of those uids are taken, one per host (the
            kernel's per-uid quotas are the host's, whatever ``root_dir`` a store uses); it and its
            directory must be this process's user's and reachable by no other (`sandbox._ids`).
            Every store whose range may overlap another's must name the same file.
        bwrap_path: the bubblewrap binary; ``None`` looks it up on PATH.
        shell: the shell (inside the sandbox) that runs command strings.
        workspace_dir: where the workspace appears inside the sandbox.
        max_layer_depth: snapshots deeper than this are squashed into one layer.
        memory_cgroup: put each environment in its own memory cgroup when the host allows it
            (see `sandbox._cgroup`); otherwise only per-process rlimits bound memory.
    """

    root_dir: str = "/var/tmp/asyncrl-sandbox"
    sandbox_uid: int = 65534
    sandbox_gid: int = 65534
    env_uid_base: int = 0x70000000
    env_uid_count: int = 65536
    env_uid_quarantine_s: float = 2.0
    env_uid_claims: str = "/run/asyncrl-sandbox/env-uids.lock"
    bwrap_path: str | None = None
    shell: str = "/bin/bash"
    workspace_dir: str = "/workspace"
    max_layer_depth: int = 16
    memory_cgroup: bool = True

    def __post_init__(self) -> None:
        if not os.path.isabs(self.root_dir):
            raise ValueError(f"SandboxConfig.root_dir={self.root_dir!r} must be an absolute path")
        bad = [c for c in ":,\\" if c in self.root_dir]
        if bad:
            raise ValueError(
                f"SandboxConfig.root_dir={self.root_dir!r} contains {bad}; overlayfs options cannot "
                "carry these characters, choose another directory"
            )
        if self.sandbox_uid <= 0 or self.sandbox_gid <= 0:
            raise ValueError(
                f"SandboxConfig.sandbox_uid/gid=({self.sandbox_uid}, {self.sandbox_gid}) must be "
                "unprivileged (> 0); use e.g. 65534 (nobody)"
            )
        if self.env_uid_count < 0 or self.env_uid_quarantine_s < 0:
            raise ValueError(
                f"SandboxConfig.env_uid_count={self.env_uid_count} and env_uid_quarantine_s="
                f"{self.env_uid_quarantine_s} must be >= 0"
            )
        if self.env_uid_count and not (self.env_uid_base >= 65536 and self.env_uid_base + self.env_uid_count < 1 << 31):
            raise ValueError(
                f"SandboxConfig.env_uid_base={self.env_uid_base} with env_uid_count={self.env_uid_count} must lie "
                "in [65536, 2**31): above the ids of real users and groups, below those tools read as negative; "
                "the default 0x70000000 is free on a systemd host"
            )
        if not os.path.isabs(self.env_uid_claims) or os.path.basename(self.env_uid_claims) in ("", ".", ".."):
            raise ValueError(
                f"SandboxConfig.env_uid_claims={self.env_uid_claims!r} must be an absolute path to a file, "
                "the same for every store of the host"
            )
        if not self.workspace_dir.startswith("/") or self.workspace_dir in ("/", "/tmp", "/usr", "/etc"):
            raise ValueError(
                f"SandboxConfig.workspace_dir={self.workspace_dir!r} must be an absolute path not "
                "shadowing a system directory, e.g. /workspace"
            )
        if not 2 <= self.max_layer_depth <= 64:
            raise ValueError(
                f"SandboxConfig.max_layer_depth={self.max_layer_depth} must be in [2, 64]; "
                "overlayfs options have a page-size limit"
            )
