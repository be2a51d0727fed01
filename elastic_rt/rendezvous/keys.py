"""The etcd key layout of one run: everything lives under /elastic-rt/<run_id>/."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_rt.errors import ConfigError

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ROOT = "/elastic-rt/"


def validate_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id or ""):
        raise ConfigError(
            f"invalid --rdzv-id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """Names of every key one run uses. Rounds are zero-padded so they sort by number."""

    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @property
    def base(self) -> str:
        return f"{ROOT}{self.run_id}/"

    @property
    def state(self) -> str:  # torch RendezvousBackend blob (etcd-v3-torch handler)
        return self.base + "state"

    @property
    def store(self) -> str:  # c10d store of the etcd-v3-torch handler
        return self.base + "store/"

    @property
    def round(self) -> str:
        return self.base + "round"

    @property
    def closed(self) -> str:
        return self.base + "closed"

    @property
    def alive_prefix(self) -> str:
        return self.base + "alive/"

    @property
    def waiting_prefix(self) -> str:
        return self.base + "waiting/"

    @property
    def rounds_prefix(self) -> str:
        return self.base + "rounds/"

    def alive(self, node_id: str) -> str:
        return self.alive_prefix + node_id

    def waiting(self, node_id: str) -> str:
        return self.waiting_prefix + node_id

    def round_prefix(self, rnd: int) -> str:
        return f"{self.rounds_prefix}{rnd:010d}/"

    def join_prefix(self, rnd: int) -> str:
        return self.round_prefix(rnd) + "join/"

    def join(self, rnd: int, node_id: str) -> str:
        return self.join_prefix(rnd) + node_id

    def final(self, rnd: int) -> str:
        return self.round_prefix(rnd) + "final"

    def round_store(self, rnd: int) -> str:
        return self.round_prefix(rnd) + "store/"
