"""`--rdzv-conf secret_file=PATH`: read once, whitespace trimmed; a bad file is a one-line ConfigError."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous import registration
from elastic_rt.rendezvous.backend import StateEnvelope


def test_secret_is_the_file_without_surrounding_whitespace(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"  0123456789abcdef\n")
    assert registration.read_secret_file(str(path)) == b"0123456789abcdef"


@pytest.mark.parametrize("content,words", [
    (None, "cannot read it (No such file or directory)"),
    (b" \n", "the file is empty"),
    ("dir", "cannot read it (Is a directory)"),
], ids=["missing", "empty", "directory"])
def test_bad_secret_file_is_one_config_line(tmp_path, content, words):
    path = tmp_path / "secret"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as exc_info:
        registration.read_secret_file(str(path))
    text = str(exc_info.value)
    assert "\n" not in text and f"secret_file={path}" in text and words in text


def test_torch_handler_reads_the_secret_before_it_contacts_etcd(tmp_path):
    params = RendezvousParameters(backend="etcd-v3-torch", endpoint="127.0.0.1:1", run_id="job",
                                  min_nodes=1, max_nodes=1, secret_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="secret_file"):
        registration.create_etcd_v3_torch_handler(params)


def test_envelope_refuses_an_empty_secret():
    with pytest.raises(ValueError):
        StateEnvelope("/k", b"")


def test_envelope_round_trip_and_tamper(tmp_path):
    signed = StateEnvelope("/k", b"s3cret")
    blob = signed.seal(b"torch bytes")
    assert signed.open(blob) == b"torch bytes"
    assert StateEnvelope("/k").open(StateEnvelope("/k").seal(b"")) == b""
    flipped = blob[:-1] + bytes((blob[-1] ^ 1,))
    with pytest.raises(RendezvousStateError, match="another secret"):
        signed.open(flipped)


def test_json_handler_reads_the_secret_before_it_contacts_etcd(tmp_path):
    """etcd-v3 signs its finals and `closed` with the secret: a bad file stops it at start, as for etcd-v3-torch."""
    params = RendezvousParameters(backend="etcd-v3", endpoint="127.0.0.1:1", run_id="job",
                                  min_nodes=1, max_nodes=1, secret_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="secret_file"):
        registration.create_etcd_v3_handler(params)
