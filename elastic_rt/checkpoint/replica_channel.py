"""The replica channel between nodes' memory tiers: its wire format, authenticated with the job secret, and its client.

One request per TCP connection. The server opens with a random nonce; the client sends a header
(one JSON line: op, path, size, crc32) and the HMAC-SHA256 of nonce + header under the job secret,
then the body (PUT). The server answers with a header and its own HMAC (over nonce + "reply" +
header), then the body (GET). A peer without the secret can neither read, write nor list, and
cannot answer in a server's place. Bodies are sent by sendfile (no copy through the sender's
memory) and received in chunks of CHUNK_BYTES: a server holds at most one chunk of a file it
receives (a GET's reader holds the file it reads, as a read from storage does), and a GET's bytes
are checked against the crc32 its reply header announced (what it holds is checked against the
manifest by the loader, as for storage).
Paths are relative to the tier's root and must be plain names below it (no "..", no absolute path).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
import socket
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

from elastic_rt.errors import CheckpointError
from elastic_rt.checkpoint import checksum

NONCE_BYTES = 16
MAC_BYTES = 32
CHUNK_BYTES = 4 << 20
MAX_HEADER_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0


class ChannelError(CheckpointError):
    """A replica peer refused, failed or could not be reached."""


def mac(secret: bytes, nonce: bytes, header: bytes, *, reply: bool = False) -> bytes:
    return hmac.new(secret, nonce + (b"reply" if reply else b"") + header, hashlib.sha256).digest()


def safe_relpath(path: str) -> str | None:
    """`path` normalised if it stays below the root; None otherwise."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\x00" in path:
        return None
    norm = posixpath.normpath(path)
    return None if norm == ".." or norm.startswith("../") else norm


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, CHUNK_BYTES))
        if not chunk:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_into_buffer(sock: socket.socket, n: int) -> bytearray:
    """n bytes received straight into one buffer (a file's bytes: no second copy)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK_BYTES))
        if not k:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def recv_line(sock: socket.socket) -> bytes:
    out = bytearray()
    while not out.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("peer closed the connection mid-header")
        out += byte
        if len(out) > MAX_HEADER_BYTES:
            raise ConnectionError("header too long")
    return bytes(out)


def send_header(sock: socket.socket, secret: bytes, nonce: bytes, header: dict[str, Any], *,
                reply: bool = False) -> None:
    line = json.dumps(header, sort_keys=True).encode() + b"\n"
    sock.sendall(line + mac(secret, nonce, line, reply=reply))


def recv_header(sock: socket.socket, secret: bytes, nonce: bytes, *, reply: bool = False) -> dict[str, Any] | None:
    """The header, or None when its HMAC does not verify under `secret`."""
    line = recv_line(sock)
    tag = recv_exact(sock, MAC_BYTES)
    if not hmac.compare_digest(tag, mac(secret, nonce, line, reply=reply)):
        return None
    header = json.loads(line)
    return header if isinstance(header, dict) else None


def send_file(sock: socket.socket, f: BinaryIO) -> None:
    """The rest of `f` (from its position), by the kernel's sendfile where it can (a file in /dev/shm goes to
    the socket without passing through this process); its crc32 is already known to the receiver."""
    sock.sendfile(f)


def recv_chunks(sock: socket.socket, n: int) -> Iterator[memoryview]:
    """n bytes as views of one reused CHUNK_BYTES buffer, each valid until the next is taken."""
    buf = bytearray(min(n, CHUNK_BYTES))
    view, got = memoryview(buf), 0
    while got < n:
        want = min(n - got, CHUNK_BYTES)
        filled = 0
        while filled < want:
            k = sock.recv_into(view[filled:want])
            if not k:
                raise ConnectionError(f"peer closed the connection after {got + filled} of {n} bytes")
            filled += k
        got += filled
        yield view[:filled]


def file_chunks(f: BinaryIO) -> Iterable[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


@dataclass(frozen=True, kw_only=True)
class ReplicaClient:
    """Requests to one node's replica server at `address` ("host:port")."""

    address: str
    secret: bytes
    timeout_s: float = IO_TIMEOUT_S

    def _connect(self) -> tuple[socket.socket, bytes]:
        host, _, port = self.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(self.timeout_s)
            nonce = recv_exact(sock, NONCE_BYTES)
        except (OSError, ValueError) as exc:
            raise ChannelError(f"replica peer {self.address} cannot be reached ({exc})") from exc
        return sock, nonce

    def _request(self, header: dict[str, Any], body: BinaryIO | None = None) -> tuple[socket.socket, dict[str, Any]]:
        sock, nonce = self._connect()
        try:
            send_header(sock, self.secret, nonce, header)
            if body is not None:
                send_file(sock, body)
            reply = recv_header(sock, self.secret, nonce, reply=True)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ChannelError(f"replica peer {self.address}: {header['op']} {header.get('path', '')} failed "
                               f"({type(exc).__name__}: {exc})") from exc
        if reply is None:
            sock.close()
            raise ChannelError(f"replica peer {self.address} answered without the job secret's signature; "
                               "give every node the same --rdzv-conf secret_file")
        if reply.get("error"):
            sock.close()
            if reply.get("missing"):
                raise FileNotFoundError(header.get("path", ""))
            raise ChannelError(f"replica peer {self.address}: {reply['error']}")
        return sock, reply

    def listdir(self, path: str) -> dict[str, int | None]:
        sock, reply = self._request({"op": "list", "path": path})
        sock.close()
        return {str(k): (None if v is None else int(v)) for k, v in reply["entries"].items()}

    def get(self, path: str) -> bytearray:
        sock, reply = self._request({"op": "get", "path": path})
        with sock:
            try:
                data = recv_into_buffer(sock, int(reply["size"]))
            except (OSError, ValueError) as exc:
                raise ChannelError(f"replica peer {self.address}: reading {path} failed ({exc})") from exc
        if checksum.crc32(data) != reply["crc32"]:
            raise ChannelError(f"replica peer {self.address}: {path} arrived damaged (crc32)")
        return data

    def put_file(self, path: str, local_path: str, *, crc32: int) -> None:
        """Send the file at `local_path`; the peer keeps it only if its bytes match `crc32`."""
        size = os.path.getsize(local_path)
        with open(local_path, "rb") as f:
            sock, _ = self._request({"op": "put", "path": path, "size": size, "crc32": crc32}, body=f)
        sock.close()
