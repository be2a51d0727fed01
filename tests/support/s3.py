"""A real S3 server for tests (moto's standalone server, in a process of its own) and an HTTP shim in front
of it that answers chosen requests with S3's own throttling and server errors.

moto honours `If-None-Match: *` on PutObject (412 PreconditionFailed when the key exists), which
is what the checkpoint commit relies on on S3.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

ACCESS_KEY = "elastic-rt-test-key"
SECRET_KEY = "elastic-rt-test-secret-do-not-log"
SLOW_DOWN = (503, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                  b"<Message>Please reduce your request rate.</Message></Error>")
INTERNAL = (500, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                 b"<Message>We encountered an internal error. Please try again.</Message></Error>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """`python -m moto.server` on a free loopback port; stop() ends it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def client_env(endpoint: str) -> dict[str, str]:
    """What a worker process needs to reach the test server through botocore's own variables."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}


def storage_options(endpoint: str) -> dict:
    return {"key": ACCESS_KEY, "secret": SECRET_KEY, "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def make_bucket(endpoint: str, name: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(endpoint.rsplit(":", 1)[1]), timeout=10)
    conn.request("PUT", f"/{name}")
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"creating bucket {name}: HTTP {response.status}")


@dataclass
class Fault:
    """Answer `times` requests for which `match(method, path)` holds with (status, body)."""

    match: Callable[[str, str], bool]
    times: int
    answer: tuple[int, bytes] = SLOW_DOWN
    hits: int = 0


@dataclass
class FaultShim:
    """An HTTP server that forwards every request to `upstream` unless a Fault claims it."""

    upstream_port: int
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str, int]] = field(default_factory=list)  # method, path, status answered

    def __post_init__(self) -> None:
        shim = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                return

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = _read_chunked(self.rfile)
                status, headers, payload = shim._answer(self.command, self.path, dict(self.headers), body)
                self.send_response(status)
                head = self.command == "HEAD"  # its Content-Length is the object's, and it has no body
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "connection") and (
                            head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="s3-fault-shim", daemon=True).start()

    def _answer(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, list, bytes]:
        with self._lock:
            fault = next((f for f in self.faults if f.hits < f.times and f.match(method, path)), None)
            if fault is not None:
                fault.hits += 1
        if fault is not None:
            self.seen.append((method, path, fault.answer[0]))
            return fault.answer[0], [("Content-Type", "application/xml")], fault.answer[1]
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        headers = {k: v for k, v in headers.items() if k.lower() not in ("transfer-encoding",)}
        headers["Content-Length"] = str(len(body))
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        self.seen.append((method, path, response.status))
        return response.status, response.getheaders(), payload

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _read_chunked(stream) -> bytes:
    out = b""
    while True:
        size = int(stream.readline().strip().split(b";")[0], 16)
        if size == 0:
            stream.readline()
            return out
        out += stream.read(size)
        stream.readline()


def env_without_aws() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
