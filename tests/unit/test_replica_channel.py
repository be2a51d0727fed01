"""The replica channel against a real replica server on loopback: the job secret is required both ways,
a replica is kept only when its crc32 matches, paths stay below the tier, the budget holds."""

from __future__ import annotations

import os
import zlib

import pytest
from prometheus_client import CollectorRegistry

from elastic_rt.agent.replica_server import ReplicaServer, ReplicaServerConfig
from elastic_rt.checkpoint.replica_channel import ChannelError, ReplicaClient

SECRET = b"s3cret"


@pytest.fixture()
def server(tmp_path):
    registry = CollectorRegistry()
    srv = ReplicaServer(ReplicaServerConfig(directory=str(tmp_path / "tier"), secret=SECRET, node="n1",
                                            max_replica_bytes=1000), registry=registry).start()
    srv.registry = registry
    yield srv
    srv.close()


def _file(tmp_path, data: bytes) -> str:
    path = tmp_path / "src"
    path.write_bytes(data)
    return str(path)


def test_put_get_list_with_the_secret(server, tmp_path):
    client = ReplicaClient(address=server.address, secret=SECRET)
    data = os.urandom(500)
    client.put_file("step_00000002/save-x/__0_0.distcp", _file(tmp_path, data), crc32=zlib.crc32(data))
    assert client.get("step_00000002/save-x/__0_0.distcp") == data
    assert client.listdir("step_00000002/save-x") == {"__0_0.distcp": 500}
    assert server.registry.get_sample_value("elastic_rt_memory_tier_bytes", {"node": "n1", "kind": "replicas"}) == 500
    with pytest.raises(FileNotFoundError):
        client.get("step_00000002/save-x/__1_0.distcp")


def test_wrong_secret_is_refused_and_learns_nothing(server, tmp_path):
    ReplicaClient(address=server.address, secret=SECRET).put_file("f", _file(tmp_path, b"x"), crc32=zlib.crc32(b"x"))
    stranger = ReplicaClient(address=server.address, secret=b"another", timeout_s=5.0)
    with pytest.raises(ChannelError):
        stranger.get("f")
    with pytest.raises(ChannelError):
        stranger.put_file("g", _file(tmp_path, b"y"), crc32=zlib.crc32(b"y"))
    assert not os.path.exists(os.path.join(server.replicas, "g"))
    assert server.registry.get_sample_value("elastic_rt_memory_tier_replicas_refused_total",
                                            {"node": "n1", "reason": "unauthenticated"}) == 2


def test_replica_with_a_wrong_crc32_is_not_kept(server, tmp_path):
    client = ReplicaClient(address=server.address, secret=SECRET)
    with pytest.raises(ChannelError, match="crc32"):
        client.put_file("bad", _file(tmp_path, b"abc"), crc32=zlib.crc32(b"abd"))
    assert os.listdir(server.replicas) == []


def test_paths_outside_the_tier_are_refused(server, tmp_path):
    client = ReplicaClient(address=server.address, secret=SECRET)
    for path in ("../escape", "/etc/passwd", "a/../../b"):
        with pytest.raises(ChannelError, match="bad path"):
            client.put_file(path, _file(tmp_path, b"z"), crc32=zlib.crc32(b"z"))
    assert not os.path.exists(os.path.join(os.path.dirname(server.config.directory), "escape"))


def test_the_replica_budget_holds(server, tmp_path):
    client = ReplicaClient(address=server.address, secret=SECRET)
    data = os.urandom(600)
    client.put_file("one", _file(tmp_path, data), crc32=zlib.crc32(data))
    with pytest.raises(ChannelError, match="budget"):
        client.put_file("two", _file(tmp_path, data), crc32=zlib.crc32(data))
    assert sorted(os.listdir(server.replicas)) == ["one"]
