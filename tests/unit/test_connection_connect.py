"""How the etcd connection reaches its member (connection.py): an address literal, the usual --rdzv-endpoint, is
connected to without a name lookup; a name is resolved as before; a refused port is the same error either way."""

from __future__ import annotations

import socket

import pytest

from elastic_rt.rendezvous.connection import Connection, _open_socket
from elastic_rt.rendezvous.wire import CallError
from tests.support.h2_member import Member
from tests.support.net import refuses


@pytest.fixture
def lookups(monkeypatch):
    """The hosts socket.getaddrinfo was asked for (it still answers)."""
    asked: list[str] = []
    real = socket.getaddrinfo

    def counting(host, *args, **kwargs):
        asked.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    return asked


def test_an_address_literal_is_connected_to_without_a_name_lookup(lookups):
    member = Member()
    conn = Connection("127.0.0.1", member.port, authority="m", ssl_context=None, timeout_s=5, name="test")
    try:
        member.accept()  # connected
        assert lookups == []
    finally:
        conn.close()
        member.close()


def test_a_name_is_resolved(lookups):
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sock = _open_socket("localhost", srv.getsockname()[1], 5.0)
        sock.close()
    assert lookups == ["localhost"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_refused_port_fails_the_connection_as_unavailable_either_way(host):
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
    assert refuses("127.0.0.1", port)
    with pytest.raises(CallError) as err:
        Connection(host, port, authority="m", ssl_context=None, timeout_s=5, name="test")
    assert err.value.code().name == "UNAVAILABLE" and "refused" in err.value.details().lower()
