"""Testing helpers (public API): a real moto S3 server in a subprocess and a fault-injecting proxy.

    with MotoServer() as moto, FaultProxy(moto.endpoint) as proxy:
        store = open_store("s3://bucket/prefix", s3_endpoint=proxy.endpoint)
        proxy.fail_next(2)          # the next two requests get HTTP 503 SlowDown
        proxy.reset_next(1)         # the one after that loses its connection

Both bind free loopback ports; nothing is hard-coded and nothing outlives the context.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Literal, Self

__all__ = ["FaultProxy", "MotoServer", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on a free loopback port, stopped (whole process group) on exit."""

    def __init__(self, host: str = "127.0.0.1", startup_timeout_s: float = 60.0) -> None:
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self._process is None:
            raise RuntimeError("MotoServer is not started; call start() or use it as a context manager")
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the server and wait until it answers HTTP; returns the endpoint URL."""
        for _ in range(3):  # the free port may be taken between probe and bind: try another
            self.port = free_port(self.host)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            if self._wait_ready():
                return self.endpoint
            self.stop()
        raise RuntimeError(f"moto server did not start on {self.host} within {self.startup_timeout_s}s")

    def _wait_ready(self) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/moto-api/", timeout=1):
                    return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Terminate the server's process group; idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


FaultKind = Literal["status", "reset"]
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


class FaultProxy:
    """HTTP forward proxy in front of an S3 endpoint that fails requests on demand.

    Faults are consumed in order, one per incoming request: ``fail_next`` answers with an HTTP
    error status and an S3 XML error body (default 503 SlowDown); ``reset_next`` closes the
    connection without answering. ``num_requests`` and ``num_faults`` count what happened.
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1") -> None:
        target = upstream.removeprefix("http://").rstrip("/")
        up_host, _, up_port = target.partition(":")
        self.upstream = (up_host, int(up_port or 80))
        self._lock = threading.Lock()
        self._faults: deque[tuple[FaultKind, int, str]] = deque()
        self.num_requests = 0
        self.num_faults = 0
        self._server = http.server.ThreadingHTTPServer((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, count: int, status: int = 503, code: str = "SlowDown") -> None:
        with self._lock:
            self._faults.extend([("status", status, code)] * count)

    def reset_next(self, count: int) -> None:
        with self._lock:
            self._faults.extend([("reset", 0, "")] * count)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _next_fault(self) -> tuple[FaultKind, int, str] | None:
        with self._lock:
            self.num_requests += 1
            if not self._faults:
                return None
            self.num_faults += 1
            return self._faults.popleft()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = bytearray()
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _relay(self) -> None:
                body = self._body()
                fault = proxy._next_fault()
                if fault is not None and fault[0] == "reset":
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None:
                    self._send(fault[1], {"Content-Type": "application/xml"}, _error_xml(fault[2]))
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    payload = response.read()
                    out = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_HEADERS}
                    if self.command == "HEAD":
                        out["Content-Length"] = response.getheader("Content-Length", "0")
                    self._send(response.status, out, payload)
                finally:
                    conn.close()

            def _send(self, status: int, headers: dict[str, str], payload: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        return Handler

    def start(self) -> str:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _error_xml(code: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>injected by FaultProxy</Message>"
        "<RequestId>fault</RequestId></Error>"
    ).encode()
