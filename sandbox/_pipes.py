"""The host's ends of a sandboxed command's pipes, each fd owned by one object that closes it once.

Not ``loop.connect_read_pipe``/``connect_write_pipe``: under uvloop (the actors' loop, up to at
least 0.23) those hand the file object's fd number to libuv, which closes it when the transport
closes, and then close the file object too (uvloop issue #763): every command's stdout, stderr
and stdin closed twice. The second close hits whatever another thread was given that number in
between: an environment's spawner thread forking the next command (Popen's own pipes), a worker
of ``asyncio.to_thread``; that thread's fd is gone or, reused again, is someone else's (a
command's pidfd closed under it: EBADF when the command releases it). Here each fd is read or
written with plain system calls from ``add_reader``/``add_writer`` callbacks, which never close
anything, and closed by its owner, once, the same on any event loop.

All methods run on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

__all__ = ["PipeReader", "PipeWriter", "close_all"]

_READ_CHUNK = 1 << 16
_CHUNKS_PER_WAKE = 16  # a fast writer cannot hold the loop in one callback


def close_all(fds: tuple[int, ...]) -> None:
    """Close each of ``fds`` (the caller owns them and gives them up here); every close is
    attempted, the first error is raised after the rest (an EBADF here is a double close)."""
    error: OSError | None = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            error = error or e
    if error is not None:
        raise error


class _Pipe:
    """A new pipe: the host's end, kept until `close`, and the child's end until `take_child_fd`."""

    def __init__(self, host_end_is_read: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._finished = asyncio.Event()
        read_fd, write_fd = os.pipe()  # both close-on-exec; the fork dup2s the child's end in place
        self._fd: int | None = read_fd if host_end_is_read else write_fd
        self._child_fd: int | None = write_fd if host_end_is_read else read_fd
        try:
            os.set_blocking(self._fd, False)
        except BaseException:
            self.close()
            raise

    @property
    def child_fd(self) -> int:
        """The number of the child's end (still this pipe's until `take_child_fd`)."""
        if self._child_fd is None:
            raise RuntimeError("the child's end of this pipe was already taken")
        return self._child_fd

    def take_child_fd(self) -> int:
        """The child's end, now the caller's to close (`Spawner.spawn` closes it once forked)."""
        fd, self._child_fd = self._child_fd, None
        if fd is None:
            raise RuntimeError("the child's end of this pipe was already taken")
        return fd

    def close(self) -> None:
        """Stop watching the host's end and close what this pipe still owns (idempotent)."""
        child_fd, self._child_fd = self._child_fd, None
        try:
            self._close_host_end()
        finally:
            if child_fd is not None:
                os.close(child_fd)

    def _close_host_end(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self._unwatch(fd)
            self._finished.set()
            os.close(fd)

    def _unwatch(self, fd: int) -> None:
        raise NotImplementedError


class PipeReader(_Pipe):
    """Reads a new pipe to its end, keeping the first ``cap`` bytes; ``on_data`` is called after
    each read. The host's (read) end is closed at end of file or by `close`, whichever is first."""

    def __init__(self, cap: int) -> None:
        super().__init__(host_end_is_read=True)
        self.cap = cap
        self.data = bytearray()
        self.truncated = False
        self.error: OSError | None = None
        self.on_data: Callable[[], None] | None = None
        assert self._fd is not None
        try:
            self._loop.add_reader(self._fd, self.read_available)
        except BaseException:
            self.close()
            raise

    def _unwatch(self, fd: int) -> None:
        self._loop.remove_reader(fd)

    def read_available(self) -> None:
        """Take what the pipe holds now (end of file closes it)."""
        if self._fd is None:
            return
        try:
            for _ in range(_CHUNKS_PER_WAKE):
                chunk = os.read(self._fd, _READ_CHUNK)
                if not chunk:
                    self._close_host_end()
                    break
                self._keep(chunk)
        except BlockingIOError:
            pass
        except OSError as e:  # our own pipe cannot fail: said by `wait`, not lost
            self.error = e
            self._close_host_end()
        if self.on_data is not None:
            self.on_data()

    def _keep(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            self.data += chunk[: max(room, 0)]
        else:
            self.data += chunk

    async def wait(self) -> None:
        """Until end of file (or `close`).

        Raises:
            OSError: reading the pipe failed.
        """
        await self._finished.wait()
        if self.error is not None:
            raise self.error


class PipeWriter(_Pipe):
    """Writes ``data`` into a new pipe, then closes its host's (write) end, also when the reader
    went away first."""

    def __init__(self, data: bytes) -> None:
        super().__init__(host_end_is_read=False)
        self._view = memoryview(data)
        try:
            self._write_available()
            if self._fd is not None:
                self._loop.add_writer(self._fd, self._write_available)
        except BaseException:
            self.close()
            raise

    def _unwatch(self, fd: int) -> None:
        self._loop.remove_writer(fd)  # (a no-op if never watched)

    def _write_available(self) -> None:
        if self._fd is None:
            return
        try:
            while self._view:
                self._view = self._view[os.write(self._fd, self._view) :]
        except BlockingIOError:
            return
        except (BrokenPipeError, ConnectionResetError):  # the command did not read it all: its choice
            pass
        self._close_host_end()  # all written: the command reads end of file

    async def wait(self) -> None:
        """Until all was written (or the reader went away, or `close`)."""
        await self._finished.wait()
