"""`--rdzv-conf` is strict: unknown keys, a user over plaintext, etcd-v3-torch without a secret are refused in
one line; the password from the environment is taken out of it; what the job secret signs (signing.py)."""

from __future__ import annotations

import json
import os

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.cli import build_parser
from elastic_rt.launch_config import launch_config_from_args
from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous import conf as rdzv_conf
from elastic_rt.rendezvous import registration
from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.rendezvous.etcd_client import EtcdConfig, KeyValue
from elastic_rt.rendezvous.registration import ENV_ETCD_PASSWORD, etcd_config_from_conf
from elastic_rt.rendezvous.signing import KeySigner, master_refusal, registered_addr


def _launch(*conf: str, backend: str = "etcd-v3"):
    args = build_parser(environ={}).parse_args(
        ["launch", "--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint", "127.0.0.1:2379",
         "--rdzv-id", "job", "--rdzv-conf", ",".join(conf), "train.py"])
    return launch_config_from_args(args, environ={})


def test_an_unknown_key_is_refused_with_the_valid_ones():
    # the typo that silently fell back to plaintext: cacert_file= instead of ca_cert=
    with pytest.raises(ConfigError) as info:
        _launch("cacert_file=/etc/ca.pem")
    text = str(info.value)
    assert "\n" not in text and "unknown key cacert_file for --rdzv-backend etcd-v3" in text
    assert "valid keys: " in text and "ca_cert" in text and "password_file" in text


def test_keys_of_the_other_etcd_backend_are_named_as_such():
    with pytest.raises(ConfigError, match="unknown key keep_alive_interval .*read by etcd-v3-torch only"):
        _launch("keep_alive_interval=5")
    with pytest.raises(ConfigError, match="unknown key lease_ttl .*read by etcd-v3 only"):
        _launch("lease_ttl=5", "insecure_state=1", backend="etcd-v3-torch")


def test_known_keys_and_aliases_pass_and_torch_backends_are_not_checked():
    cfg = _launch("cacert=/etc/ca.pem", "lease_ttl=5", "launch_id=42")
    assert cfg.conf["ca_cert"] == "/etc/ca.pem" and "cacert" not in cfg.conf
    assert _launch("anything=1", backend="c10d").conf["anything"] == "1"  # torch's own backends read their keys
    with pytest.raises(ConfigError, match="gives ca_cert twice"):
        _launch("cacert=/a", "ca_cert=/b")


def test_close_timeout_bounds_how_long_a_finished_job_tries_to_mark_the_run_closed():
    def settings(**conf):
        return registration.settings_from_params(RendezvousParameters(
            backend="etcd-v3", endpoint="127.0.0.1:1", run_id="job", min_nodes=1, max_nodes=1, **conf))

    assert settings().close_timeout_s == 30.0
    assert settings(close_timeout="5").close_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"^--rdzv-conf close_timeout='0' must be > 0$"):
        settings(close_timeout="0")


def test_the_handler_factory_checks_the_keys_too():
    """torchrun reaches the handler through the entry point, without elastic-rt's config."""
    params = RendezvousParameters(backend="etcd-v3", endpoint="127.0.0.1:1", run_id="job", min_nodes=1,
                                  max_nodes=1, ssl_cert_file="/x.pem")
    with pytest.raises(ConfigError, match="unknown key ssl_cert_file"):
        registration.create_etcd_v3_handler(params)


def test_a_user_over_plaintext_is_refused_unless_allowed():
    with pytest.raises(ConfigError) as info:
        etcd_config_from_conf("127.0.0.1:2379", {"user": "job42"}, timeout_s=1.0, env={ENV_ETCD_PASSWORD: "pw"})
    assert "\n" not in str(info.value) and "over plaintext etcd" in str(info.value)
    assert "allow_plaintext_auth=1" in str(info.value)
    cfg = etcd_config_from_conf("127.0.0.1:2379", {"user": "job42", "allow_plaintext_auth": "1"}, timeout_s=1.0,
                                env={ENV_ETCD_PASSWORD: "pw"})
    assert cfg.user == "job42" and cfg.password == "pw"
    assert etcd_config_from_conf("https://127.0.0.1:2379", {"user": "job42"}, timeout_s=1.0, env={}).secure
    with pytest.raises(ConfigError, match="expected 1 or 0"):
        etcd_config_from_conf("127.0.0.1:2379", {"user": "u", "allow_plaintext_auth": "maybe"}, timeout_s=1.0)


def test_the_password_variable_leaves_the_agents_environment_once_read(monkeypatch):
    monkeypatch.setenv(ENV_ETCD_PASSWORD, "from-env")
    cfg = etcd_config_from_conf("https://127.0.0.1:2379", {"user": "u"}, timeout_s=1.0)
    assert cfg.password == "from-env"
    assert ENV_ETCD_PASSWORD not in os.environ  # what the workers inherit


def test_torch_backend_without_a_secret_is_refused_unless_insecure_state():
    params = RendezvousParameters(backend="etcd-v3-torch", endpoint="127.0.0.1:1", run_id="job", min_nodes=1,
                                  max_nodes=1)
    with pytest.raises(ConfigError) as info:
        registration.create_etcd_v3_torch_handler(params)
    text = str(info.value)
    assert "\n" not in text and "runs code in every agent" in text and "insecure_state=1" in text
    params.config["insecure_state"] = "1"
    handler = registration.create_etcd_v3_torch_handler(params)  # builds without contacting etcd
    assert handler.get_backend() == "etcd-v3-torch"


def test_the_readme_table_has_every_key():
    from tests.support import cli_docs

    table = cli_docs.rdzv_conf_table()
    for key in rdzv_conf.KEYS:
        assert f"`{key.key}`" in table


def _kv(key: str, value: bytes) -> KeyValue:
    return KeyValue(key, value, 1, 1, 0)


def test_signed_values_round_trip_and_forgeries_are_refused():
    signer = KeySigner(b"job-secret")
    key = "/elastic-rt/job/rounds/0000000001/final"
    sealed = signer.seal(key, {"round": 1, "nodes": ["a", "b"], "master": ["10.0.0.1", 29500]})
    assert signer.refusal(key, sealed) is None
    data = json.loads(sealed)
    data["master"] = ["10.6.6.6", 29500]  # the forger's own store
    assert signer.refusal(key, json.dumps(data).encode()) == "is signed with another secret (or was altered)"
    assert signer.refusal(key.replace("01/", "02/"), sealed) is not None  # copied to another round
    unsigned = json.dumps({"round": 1, "nodes": ["a"]}).encode()
    assert "is not signed" in signer.refusal(key, unsigned)
    assert KeySigner(b"other").refusal(key, sealed) is not None
    assert KeySigner().refusal(key, unsigned) is None and json.loads(KeySigner().seal(key, {"a": 1})) == {"a": 1}
    with pytest.raises(ValueError):
        KeySigner(b"")


def test_master_must_be_the_address_rank0_registered():
    alive = _kv("/elastic-rt/job/alive/a", json.dumps({"addr": "10.0.0.1", "incarnation": "x"}).encode())
    assert registered_addr(alive) == "10.0.0.1" and registered_addr(None) is None
    assert master_refusal(("10.0.0.1", 29500), "a", "10.0.0.1") is None
    assert "not the address rank 0 (a) registered (10.0.0.1)" in master_refusal(("10.6.6.6", 1), "a", "10.0.0.1")
    assert "no registration" in master_refusal(("10.0.0.1", 1), "a", None)


def test_fingerprint_names_what_differs():
    a = JobFingerprint.of(script="train.py", script_args=("--lr", "0.1"), min_nodes=2, max_nodes=4)
    b = JobFingerprint.of(script="other.py", script_args=("--lr", "0.2"), min_nodes=2, max_nodes=2, launch_id="7")
    assert JobFingerprint.decode(a.encode()) == a and JobFingerprint.decode(b"junk") is None
    text = a.differences(b)
    assert "its script is other.py, not train.py" in text and "arguments differ" in text
    assert "its --nnodes is 2, not 2:4" in text and "its launch_id is 7, not (none)" in text
    assert a.differences(a) == "its fingerprint differs"  # never asked for equal ones: says so anyway


def test_agents_spread_over_the_listed_endpoints_by_their_node_id():
    endpoints = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    firsts = [etcd_config_from_conf(endpoints, {}, timeout_s=5, spread_key=f"node-{i}").first for i in range(300)]
    counts = [firsts.count(i) for i in range(3)]
    assert min(counts) >= 80, counts  # 100 each, give or take the hash's spread
    again = [etcd_config_from_conf(endpoints, {}, timeout_s=5, spread_key=f"node-{i}").first for i in range(300)]
    assert again == firsts  # stable: a restarted agent goes back to the member it had


def test_endpoint_order_listed_and_one_off_commands_start_at_the_first_endpoint():
    endpoints = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    listed = {etcd_config_from_conf(endpoints, {"endpoint_order": "listed"}, timeout_s=5, spread_key=f"n{i}").first
              for i in range(30)}
    assert listed == {0}
    assert etcd_config_from_conf(endpoints, {}, timeout_s=5).first == 0  # status, gc, doctor: no node id
    assert etcd_config_from_conf("10.0.0.1:2379", {}, timeout_s=5, spread_key="g").first == 0


def test_a_bad_endpoint_order_is_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        etcd_config_from_conf("10.0.0.1:2379", {"endpoint_order": "random"}, timeout_s=5, spread_key="a")
    assert "\n" not in str(info.value) and "endpoint_order='random': expected spread or listed" in str(info.value)
    with pytest.raises(ConfigError, match="endpoint index 3 is not one of the 3 endpoints"):
        EtcdConfig(endpoints=(("a", 1), ("b", 1), ("c", 1)), first=3)


def test_keep_alives_go_to_the_leader_unless_keepalive_to_member_and_a_bad_value_is_one_line():
    endpoints = "10.0.0.1:2379,10.0.0.2:2379"
    assert etcd_config_from_conf(endpoints, {}, timeout_s=5, spread_key="a").keepalive_to_leader
    assert not etcd_config_from_conf(endpoints, {"keepalive_to": "Member"}, timeout_s=5,
                                     spread_key="a").keepalive_to_leader
    with pytest.raises(ConfigError) as info:
        etcd_config_from_conf(endpoints, {"keepalive_to": "first"}, timeout_s=5, spread_key="a")
    assert "\n" not in str(info.value) and "keepalive_to='first': expected leader or member" in str(info.value)


def test_the_torch_backend_spreads_by_its_node_id_and_checks_no_name():
    params = RendezvousParameters(backend="etcd-v3-torch", endpoint="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", run_id="job",
                                  min_nodes=1, max_nodes=1, insecure_state="1", node_id="g")
    handler = registration.create_etcd_v3_torch_handler(params)  # builds without contacting etcd
    client = handler._state_holder._backend._client  # torch 2.13's handler -> its state holder -> our backend
    assert client.current_endpoint == "127.0.0.1:2"  # spread_first("g", 3) == 1
    params.config["node_id"] = "gpu 7"  # torch's handler never checked the name: it still does not
    assert registration.create_etcd_v3_torch_handler(params).get_backend() == "etcd-v3-torch"
