"""A minimal SNTP (RFC 4330) client: one query, offset and round trip in seconds."""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable

from elastic_rt.errors import ConfigError, HealthCheckError

NTP_PORT = 123
NTP_EPOCH_OFFSET_S = 2_208_988_800  # seconds from 1900-01-01 to 1970-01-01
_PACKET = struct.Struct("!BBbbII4sQQQQ")  # 48 bytes
_LI_UNSYNC = 3
_MODE_CLIENT = 3
_MODE_SERVER = 4
_VERSION = 4


@dataclass(frozen=True, kw_only=True)
class NtpResult:
    """One SNTP exchange. offset_s > 0 means the server's clock is ahead of ours."""

    server: str
    offset_s: float
    round_trip_s: float
    stratum: int
    leap: int


def to_ntp(unix_s: float) -> int:
    """Unix seconds -> 64-bit NTP timestamp (32.32 fixed point since 1900)."""
    ntp = unix_s + NTP_EPOCH_OFFSET_S
    return (int(ntp) << 32) | int((ntp % 1.0) * (1 << 32))


def from_ntp(ntp: int) -> float:
    """64-bit NTP timestamp -> Unix seconds."""
    return (ntp >> 32) - NTP_EPOCH_OFFSET_S + (ntp & 0xFFFFFFFF) / (1 << 32)


def offset_and_delay(t1: float, t2: float, t3: float, t4: float) -> tuple[float, float]:
    """NTP on-wire formula: t1 client send, t2 server receive, t3 server send, t4 client receive."""
    return ((t2 - t1) + (t3 - t4)) / 2.0, (t4 - t1) - (t3 - t2)


def parse_server(spec: str) -> tuple[str, int]:
    """'host', 'host:port', '[v6]:port' or 'v6' -> (host, port)."""
    spec = spec.strip()
    if not spec:
        raise ConfigError("empty NTP server; expected host[:port]")
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif spec.count(":") == 1:
        host, _, port_s = spec.partition(":")
    else:
        host, port_s = spec, ""
    if not port_s:
        return host, NTP_PORT
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"bad port in NTP server {spec!r}; expected host[:port]")
    return host, int(port_s)


def build_request(transmit_ntp: int) -> bytes:
    first = (0 << 6) | (_VERSION << 3) | _MODE_CLIENT
    return _PACKET.pack(first, 0, 0, 0, 0, 0, b"\0\0\0\0", 0, 0, 0, transmit_ntp)


def query(
    server: str,
    *,
    timeout_s: float = 1.0,
    clock: Callable[[], float] = time.time,
) -> NtpResult:
    """Send one SNTP request to `server` (host[:port]) and return offset and round trip.

    `clock` is the local wall clock being compared (Unix seconds). Raises
    HealthCheckError when the server does not answer within timeout_s, refuses,
    or answers with an unusable packet; ConfigError for a malformed address.
    """
    host, port = parse_server(server)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise HealthCheckError(f"NTP server {server!r} cannot be resolved ({exc}); check --ntp-server") from exc
    family, socktype, proto, _, addr = infos[0]
    # The transmit timestamp doubles as a nonce: the reply must echo it (RFC 4330 s.5),
    # so its low bits are random instead of the clock's sub-nanosecond noise.
    with socket.socket(family, socktype, proto) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(addr)
            t1 = clock()
            nonce = to_ntp(t1) ^ int.from_bytes(os.urandom(2), "big")
            sock.send(build_request(nonce))
            deadline = time.monotonic() + timeout_s
            while True:
                data = sock.recv(512)
                t4 = clock()
                if len(data) >= _PACKET.size and _PACKET.unpack_from(data)[8] == nonce:
                    break
                # A stale or foreign datagram: keep waiting for ours until the deadline.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout()
                sock.settimeout(remaining)
        except socket.timeout as exc:
            raise HealthCheckError(
                f"NTP server {server} did not answer within {timeout_s:g} s; is it reachable over UDP? "
                "see --ntp-server"
            ) from exc
        except OSError as exc:
            raise HealthCheckError(f"NTP query to {server} failed: {exc}; see --ntp-server") from exc
    return _decode(server, data, t1, t4)


def _decode(server: str, data: bytes, t1: float, t4: float) -> NtpResult:
    first, stratum, _poll, _prec, _root_delay, _root_disp, _ref_id, _ref_ts, _orig, recv, xmit = (
        _PACKET.unpack_from(data)
    )
    leap, mode = first >> 6, first & 0x7
    if mode != _MODE_SERVER:
        raise HealthCheckError(f"NTP server {server} answered with mode {mode}, not a server reply")
    if stratum == 0:
        raise HealthCheckError(f"NTP server {server} sent a kiss-of-death packet (stratum 0); it refuses us")
    if leap == _LI_UNSYNC:
        raise HealthCheckError(f"NTP server {server} says its own clock is not synchronized")
    if recv == 0 or xmit == 0:
        raise HealthCheckError(f"NTP server {server} sent a reply without timestamps")
    offset_s, delay_s = offset_and_delay(t1, from_ntp(recv), from_ntp(xmit), t4)
    return NtpResult(server=server, offset_s=offset_s, round_trip_s=max(0.0, delay_s), stratum=stratum, leap=leap)
