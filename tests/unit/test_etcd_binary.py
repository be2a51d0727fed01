"""Which etcd server the tests and the chaos tools start."""

from __future__ import annotations

import pytest

from etcd_testbed.server import ENV_ETCD_BINARY, find_etcd_binary
from elastic_rt.errors import ElasticRTError


def test_env_var_picks_the_binary(tmp_path, monkeypatch):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(ENV_ETCD_BINARY, str(fake))
    assert find_etcd_binary() == str(fake)


@pytest.mark.parametrize("make", ["missing", "not-executable", "directory"])
def test_env_var_naming_no_executable_is_one_clear_error(tmp_path, monkeypatch, make):
    target = tmp_path / "etcd"
    if make == "not-executable":
        target.write_text("")
        target.chmod(0o644)
    elif make == "directory":
        target.mkdir()
    monkeypatch.setenv(ENV_ETCD_BINARY, str(target))
    with pytest.raises(ElasticRTError, match=f"{ENV_ETCD_BINARY}=.* is not an executable file"):
        find_etcd_binary()
