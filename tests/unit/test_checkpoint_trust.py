"""The trust boundary: signed manifests, nothing unpickled unverified or outside an allow-list, file modes."""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
import zlib

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.manifest import _crc_of_body
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError


class Payload:
    """What an attacker plants: unpickling it creates a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def state() -> dict:
    return {"w": torch.arange(32, dtype=torch.float32), "extra": {"step": 1}}


def empty() -> dict:
    return {"w": torch.zeros(32), "extra": {"step": -1}}


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    return str(path)


def plant_metadata(url: str, marker: str, *, forge_manifest: bool) -> None:
    """Replace step 1's .metadata by a pickle that runs code; optionally fix up the manifest's size, crc32
    and its own crc32, as anyone who can write the URL can (only the HMAC needs the secret)."""
    entry = CheckpointStore(url).entry(1) if not forge_manifest else None
    root = url[len("file://"):]
    step = os.path.join(root, "step_00000001")
    save_dir = next(n for n in os.listdir(step) if n.startswith("save-"))
    evil = pickle.dumps(Payload(marker))
    with open(os.path.join(step, save_dir, ".metadata"), "wb") as f:
        f.write(evil)
    if not forge_manifest:
        assert entry is not None
        return
    path = os.path.join(step, "MANIFEST.json")
    body = json.loads(open(path, "rb").read())
    body.pop("manifest_crc32")
    hmac_value = body.pop("manifest_hmac", None)
    for f in body["files"]:
        if f["path"] == ".metadata":
            f["size"], f["crc32"] = len(evil), f"{zlib.crc32(evil):08x}"
            f.pop("sha256", None)
    body["manifest_crc32"] = _crc_of_body(body)
    if hmac_value is not None:
        body["manifest_hmac"] = hmac_value  # the old signature: the attacker cannot make a new one
    with open(path, "w") as f:
        json.dump(body, f)


@pytest.mark.parametrize("forge_manifest", [True, False], ids=["manifest-forged", "manifest-intact"])
def test_a_planted_metadata_pickle_is_refused_under_secret_file(tmp_path, secret, forge_manifest, caplog):
    url = f"file://{tmp_path}/ckpt"
    marker = str(tmp_path / "pwned")
    with CheckpointManager(url, secret_file=secret) as mgr:
        mgr.save(1, state())
    plant_metadata(url, marker, forge_manifest=forge_manifest)
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        with CheckpointManager(url, secret_file=secret) as mgr:
            with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
                mgr.load_latest(empty())
    assert not os.path.exists(marker)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert ("another secret" in warning) if forge_manifest else (".metadata: size" in warning)


def test_without_a_secret_metadata_is_still_unpickled_only_through_the_allow_list(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    marker = str(tmp_path / "pwned")
    with CheckpointManager(url) as mgr:
        mgr.save(1, state())
    plant_metadata(url, marker, forge_manifest=True)
    with CheckpointManager(url) as mgr:
        with pytest.raises(CheckpointError, match="not allowed in checkpoint metadata|refused to unpickle"):
            mgr.load_latest(empty())
    assert not os.path.exists(marker)


def test_signed_checkpoints_load_and_unsigned_ones_are_refused_under_a_secret(tmp_path, secret):
    url = f"file://{tmp_path}/ckpt"
    with CheckpointManager(url) as mgr:
        mgr.save(1, state())
    with CheckpointManager(url, secret_file=secret) as mgr:
        mgr.save(2, {"w": torch.ones(32), "extra": {"step": 2}})
        assert CheckpointStore(url).entry(2).manifest.files[0].sha256 is not None
        target = empty()
        assert mgr.load_latest(target) == 2
        assert torch.equal(target["w"], torch.ones(32))
    (tmp_path / "ckpt" / "step_00000002" / "MANIFEST.json").unlink()
    with CheckpointManager(url, secret_file=secret) as mgr:
        with pytest.raises(CheckpointError, match="not signed"):
            mgr.load_latest(empty())


def test_files_are_0600_and_folders_0700_unless_a_mode_is_given(tmp_path):
    def modes(root):
        found = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                found[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
        return found

    with CheckpointManager(f"file://{tmp_path}/private") as mgr:
        mgr.save(1, state())
    private = modes(tmp_path / "private")
    assert any(p.endswith(".distcp") for p in private) and "step_00000001/MANIFEST.json" in private
    for path, mode in private.items():
        expected = 0o700 if os.path.isdir(tmp_path / "private" / path) else 0o600
        assert mode == expected, (path, oct(mode))
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700
    with CheckpointManager(f"file://{tmp_path}/shared", file_mode=0o640, dir_mode=0o750) as mgr:
        mgr.save(1, state())
    for path, mode in modes(tmp_path / "shared").items():
        assert mode == (0o750 if os.path.isdir(tmp_path / "shared" / path) else 0o640), (path, oct(mode))


class Custom:
    def __init__(self, value: int = 3) -> None:
        self.value = value


@pytest.mark.parametrize("where", ["global", "per-rank"])
def test_a_value_of_an_unknown_type_is_refused_with_one_line_until_the_type_is_allowed(tmp_path, where):
    """Non-tensor values always load through torch's weights_only loader: a type of the job's own is refused,
    named, with the fix; torch.serialization.add_safe_globals (here its context-manager form) lets it in."""
    url = f"file://{tmp_path}/ckpt"
    key = "extra" if where == "global" else "rng"
    with CheckpointManager(url) as mgr:
        mgr.save(1, {"w": torch.ones(2), key: {"obj": Custom(7)}})
        with pytest.raises(CheckpointError) as exc_info:
            mgr.load_latest({"w": torch.zeros(2), key: {"obj": None}})
        text = str(exc_info.value)
        assert "\n" not in text and f"{__name__}.Custom" in text and "add_safe_globals" in text, text
        target = {"w": torch.zeros(2), key: {"obj": None}}
        with torch.serialization.safe_globals([Custom]):
            assert mgr.load_latest(target) == 1
    assert isinstance(target[key]["obj"], Custom) and target[key]["obj"].value == 7


def test_the_example_jobs_state_loads_with_the_safe_loader(tmp_path):
    """What launch/train_example.py checkpoints: model and SGD-with-momentum state through get_state_dict, the
    elastic sampler's state, the RNG states (python's is a tuple), plain extras."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils.data import TensorDataset

    from elastic_rt.checkpoint import capture_rng_state
    from elastic_rt.data import ElasticDistributedSampler

    def job(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = ElasticDistributedSampler(TensorDataset(torch.arange(64)), num_replicas=1, rank=0, seed=0)
        return model, opt, sampler

    model, opt, sampler = job(0)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    sampler.set_epoch(2)
    sampler.advance(24)
    model_sd, optim_sd = get_state_dict(model, opt)
    saved = {"model": model_sd, "optim": optim_sd, "sampler": sampler.state_dict(), "rng": capture_rng_state(),
             "extra": {"step": 5}}
    with CheckpointManager(f"file://{tmp_path}/ckpt") as mgr:
        mgr.save(5, saved)
        model2, opt2, sampler2 = job(1)
        model_sd2, optim_sd2 = get_state_dict(model2, opt2)
        target = {"model": model_sd2, "optim": optim_sd2, "sampler": sampler2.state_dict(), "rng": {},
                  "extra": {"step": 0}}
        assert mgr.load_latest(target) == 5
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    sampler2.load_state_dict(target["sampler"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], opt2.state_dict()["state"][0]["momentum_buffer"])
    assert sampler2.state_dict() == sampler.state_dict() and target["extra"] == {"step": 5}
    assert target["rng"]["python"] == saved["rng"]["python"] and torch.equal(target["rng"]["torch"], saved["rng"]["torch"])


def test_keep_last_1_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_rt.checkpoint"):
        CheckpointManager(f"file://{tmp_path}", keep_last=1).close()
    assert any("keep_last=1" in r.getMessage() for r in caplog.records)
