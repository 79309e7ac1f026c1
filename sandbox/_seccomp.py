"""The seccomp filter every sandboxed command runs under, built with libseccomp (``pyseccomp``).

Everything a build tool or test suite needs stays allowed; what is refused (with EPERM) is what
Docker's default profile refuses an unprivileged container: kernel keyrings, new namespaces and
mounts (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag, the mount API), tracing and
other processes' memory, BPF, perf events, userfaultfd, io_uring, module loading, kexec, clocks,
swap, quotas, reboot, and the legacy calls nothing uses any more. ``clone3`` passes its flags in
memory a filter cannot read, so it fails with ENOSYS and libc falls back to ``clone``, whose
flags are checked. ``personality`` takes only what Docker's profile lets through
(`PERSONALITY_ALLOWED`: the Linux default, the 32-bit ``uname``, the 2.6 ``uname``, their union
and the query): ADDR_NO_RANDOMIZE would turn ASLR off and READ_IMPLIES_EXEC make every readable
mapping executable. System calls of a foreign ABI (32-bit ``int 0x80``, x32) kill the process:
libseccomp's default for an architecture the filter was not built for.

bubblewrap loads the program (``--seccomp FD``) as the last step before it executes the
command, after ``PR_SET_NO_NEW_PRIVS``; the sandbox's init and every descendant inherit it.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile
import types

from sandbox.errors import SandboxUnavailable

__all__ = [
    "DENIED_SYSCALLS",
    "NAMESPACE_CLONE_FLAGS",
    "PERSONALITY_ALLOWED",
    "filter_fd",
    "filter_program",
    "syscall_number",
]

DENIED_SYSCALLS = (
    # keyrings are kernel-wide: a key reachable from the sandbox is the host's key
    "keyctl", "add_key", "request_key",
    # namespaces and mounts: the whole user-namespace attack surface
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr",
    # other processes: tracing, reading and writing their memory, stealing their fds
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel attack surface that sandboxed code has no use for
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init", "name_to_handle_at", "open_by_handle_at", "lookup_dcookie",
    # the machine itself: modules, kexec, clocks, swap, quotas, accounting, logs, power
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "syslog", "vhangup", "settimeofday", "stime", "clock_settime", "clock_adjtime", "iopl", "ioperm",
    # NUMA placement (CAP_SYS_NICE in Docker's profile) and legacy calls
    "mbind", "set_mempolicy", "migrate_pages", "move_pages", "nfsservctl", "uselib", "ustat", "sysfs",
    "_sysctl", "vm86", "vm86old",
)  # fmt: skip

NAMESPACE_CLONE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


_PER_LINUX32, _UNAME26, _PERSONALITY_QUERY = 0x0008, 0x0020000, 0xFFFFFFFF
# what Docker's default profile allows: PER_LINUX, PER_LINUX32, UNAME26, their union, the query
PERSONALITY_ALLOWED = (0, _PER_LINUX32, _UNAME26, _PER_LINUX32 | _UNAME26, _PERSONALITY_QUERY)


_U64 = (1 << 64) - 1


def _gaps(allowed: tuple[int, ...]) -> list[tuple[int, int]]:
    """The inclusive ranges of 64-bit values that are not in ``allowed``."""
    gaps, low = [], 0
    for value in sorted(allowed):
        if value > low:
            gaps.append((low, value - 1))
        low = value + 1
    if low <= _U64:
        gaps.append((low, _U64))
    return gaps


def _aligned_blocks(low: int, high: int) -> list[tuple[int, int]]:
    """(mask, value) pairs, ``arg & mask == value`` each, whose union is exactly [low, high]."""
    blocks = []
    while low <= high:
        size = low & -low if low else 1 << 64
        while low + size - 1 > high:
            size >>= 1
        blocks.append((_U64 & ~(size - 1), low))
        low += size
    return blocks


def _pyseccomp() -> types.ModuleType:  # imported late: importing it loads libseccomp
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:
        raise SandboxUnavailable(
            f"cannot load libseccomp's bindings ({e}); the sandbox refuses to run commands without its "
            "seccomp filter: run scripts/bootstrap.sh (pip: pyseccomp; apt: libseccomp2)"
        ) from e
    return pyseccomp


@functools.cache
def filter_program() -> bytes:
    """The compiled classic-BPF program (what ``seccomp_export_bpf`` writes), built once.

    Raises:
        SandboxUnavailable: libseccomp or its Python bindings are missing.
    """
    sc = _pyseccomp()
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED_SYSCALLS:
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if number == -1:  # __NR_SCMP_ERROR: a name this libseccomp does not know
            continue
        flt.add_rule(sc.ERRNO(errno.EPERM), number)
    for flag in NAMESPACE_CLONE_FLAGS.values():
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # personality: libseccomp compares an argument once per rule, so the values refused are
    # written as aligned blocks (a mask and a value each) covering everything between the allowed ones
    for low, high in _gaps(PERSONALITY_ALLOWED):
        for mask, value in _aligned_blocks(low, high):
            flt.add_rule(sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.MASKED_EQ, mask, value))
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


def filter_fd() -> int:
    """A pipe's read end holding the program, for one bwrap ``--seccomp`` (the caller closes it).

    A pipe and not a shared file: bwrap reads to EOF from the current offset, and concurrent
    commands would race on one file offset.
    """
    program = filter_program()
    read_fd, write_fd = os.pipe()
    try:
        if len(program) > 65536:  # a pipe's default capacity; real filters are ~1 KiB
            raise RuntimeError(f"seccomp program of {len(program)} bytes does not fit in a pipe")
        os.write(write_fd, program)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return read_fd


@functools.cache
def syscall_number(name: str) -> int:
    """This architecture's number of system call ``name`` (from libseccomp's tables)."""
    number = _pyseccomp().resolve_syscall(_pyseccomp().Arch.NATIVE, name)
    if number < 0:
        raise SandboxUnavailable(f"system call {name!r} has no number on this architecture")
    return number
