"""Small network checks shared by tests."""

from __future__ import annotations

import socket


def refuses(host: str, port: int, timeout_s: float = 5.0) -> bool:
    """Whether a TCP connection to host:port is refused now (a closed port: what a dead agent's peers see)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    return False
