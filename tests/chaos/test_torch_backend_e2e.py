"""End to end with `--rdzv-backend etcd-v3-torch` (torch's handler on elastic-rt's etcd v3 backend and store),
with and without `--rdzv-conf secret_file`: real etcd, real nodes, real workers."""

from __future__ import annotations

import pickle

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic_rt.rendezvous.backend import MAGIC, SIGNED, EtcdV3RendezvousBackend
from elastic_rt.rendezvous.keys import RunKeys
from tests.chaos.harness import EXAMPLE, Node, launch_args
from tests.chaos.test_bad_input import _one_error_line, run_cli
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - the fixture: nodes started, cleaned up after

pytestmark = pytest.mark.slow


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("9f1c2e7a5b3d4c6e8f0a1b2c3d4e5f60\n")
    return path


def _torch_args(endpoint, run_id, node_id, conf: str) -> list[str]:
    args = launch_args(endpoint, run_id, node_id, nnodes="2", steps=8, step_sleep=0.05)
    # the second --rdzv-conf replaces the harness's: say everything in it
    return args[:args.index(EXAMPLE)] + ["--rdzv-backend", "etcd-v3-torch", "--rdzv-conf", conf] \
        + args[args.index(EXAMPLE):]


@pytest.mark.parametrize("signed", [
    # the secret_file variant runs the same handler, and signs: the plain one is a long variant for CI's time
    pytest.param(False, id="plain", marks=pytest.mark.long),
    pytest.param(True, id="secret_file"),
])
def test_two_nodes_on_torch_handler_finish(etcd_client, etcd_endpoint, run_id, nodes, secret_file, signed):
    conf = "last_call_timeout=3" + (f",secret_file={secret_file}" if signed else ",insecure_state=1")
    for node_id in ("a", "b"):
        nodes.append(Node(_torch_args(etcd_endpoint, run_id, node_id, conf), name=node_id))
    for n in nodes:
        assert n.wait_exit(300) == 0, n.output[-3000:]
    done = [m for n in nodes for m in n.matches(r"done steps=(\d+) world_size=(\d+)")]
    assert [(m.group(1), m.group(2)) for m in done] == [("8", "4")]
    kv, _ = etcd_client.get(RunKeys(run_id).state)
    assert kv.value.startswith(MAGIC) and (kv.value[len(MAGIC) + 1] == SIGNED) == signed


@pytest.mark.parametrize("writer_secret,words", [
    (None, "is not signed"),
    (b"some-other-secret", "is signed with another secret"),
], ids=["written-without-secret", "written-with-wrong-secret"])
def test_state_not_signed_with_this_secret_fails_with_one_line(etcd_client, etcd_endpoint, run_id, secret_file,
                                                               writer_secret, words):
    key = RunKeys(run_id).state
    EtcdV3RendezvousBackend(etcd_client, run_id, secret=writer_secret).set_state(pickle.dumps(_RendezvousState()))
    before, _ = etcd_client.get(key)
    proc = run_cli("launch", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3-torch",
                   "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id, "--metrics-port", "0",
                   "--rdzv-conf", f"secret_file={secret_file},join_timeout=60", EXAMPLE, "--steps", "2")
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert key in line and words in line and f"etcdctl del {key}" in line and "--rdzv-id" in line
    after, _ = etcd_client.get(key)
    assert after.value == before.value  # refused, not overwritten


@pytest.mark.parametrize("content,words", [(None, "cannot read it"), ("\n", "the file is empty")],
                         ids=["missing", "empty"])
def test_bad_secret_file_is_a_config_error(tmp_path, content, words):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    proc = run_cli("launch", "--nnodes", "2", "--rdzv-backend", "etcd-v3-torch", "--rdzv-endpoint", "127.0.0.1:1",
                   "--rdzv-id", "job", "--metrics-port", "0", "--rdzv-conf", f"secret_file={path}", EXAMPLE)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert f"secret_file={path}" in line and words in line
