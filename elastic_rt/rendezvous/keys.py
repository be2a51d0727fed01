"""The etcd key layout of one run: everything lives under /elastic-rt/<run_id>/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from elastic_rt.errors import ConfigError, RendezvousDataError
from elastic_rt.rendezvous.etcd_client import prefix_end

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
    """Names of every key one run uses. Rounds are zero-padded so they sort by number. The prefixes are built
    once per instance (every node names each member's alive/ key when a round forms)."""

    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @cached_property
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
    def fingerprint(self) -> str:  # the job that uses the run (claim.py)
        return self.base + "fingerprint"

    @property
    def run_lease(self) -> str:  # the id of the run's lease, which the workers' stores are put on (run_lease.py)
        return self.base + "lease"

    @cached_property
    def alive_prefix(self) -> str:
        return self.base + "alive/"

    @cached_property
    def waiting_prefix(self) -> str:
        return self.base + "waiting/"

    @cached_property
    def rounds_prefix(self) -> str:
        return self.base + "rounds/"

    def alive(self, node_id: str) -> str:
        return self.alive_prefix + node_id

    def waiting(self, node_id: str) -> str:
        return self.waiting_prefix + node_id

    def round_prefix(self, rnd: int) -> str:
        return f"{self.rounds_prefix}{rnd:010d}/"

    @cached_property
    def joins_prefix(self) -> str:
        """The joins of every round: only the node closing a round watches them, outside the membership watch."""
        return self.base + "joins/"

    def join_prefix(self, rnd: int) -> str:
        return f"{self.joins_prefix}{rnd:010d}/"

    def join_range(self, rnd: int) -> tuple[str, bytes]:
        return self.join_prefix(rnd), prefix_end(self.join_prefix(rnd))

    def join(self, rnd: int, node_id: str) -> str:
        return self.join_prefix(rnd) + node_id

    def final(self, rnd: int) -> str:
        return self.round_prefix(rnd) + "final"

    @cached_property
    def stores_prefix(self) -> str:
        """The worker c10d stores, one per round: bulk traffic, outside the membership watch."""
        return self.base + "stores/"

    def round_store(self, rnd: int) -> str:
        return f"{self.stores_prefix}{rnd:010d}/"

    def history(self, rnd: int) -> tuple[tuple[str, str], ...]:
        """(start, end) ranges of every round before `rnd` (its keys, joins and worker stores): what rank 0 deletes
        once round rnd + 1 formed. Each end is a prefix of a round's keys, so `round` and the other keys are outside."""
        return ((self.rounds_prefix, self.round_prefix(rnd)), (self.joins_prefix, self.join_prefix(rnd)),
                (self.stores_prefix, self.round_store(rnd)))

    @property
    def alive_range(self) -> tuple[str, bytes]:
        return self.alive_prefix, prefix_end(self.alive_prefix)

    def watch_ranges(self) -> list[tuple[str, bytes]]:
        """(start, end) ranges of every membership key: the whole run except the joins and the worker stores,
        whose traffic grows with the number of nodes. The alive keys are a range of their own
        (MembershipView watches only their deletions until this node is a member of a round)."""
        return [self.alive_range,  # nothing of the run's sorts before alive/
                (prefix_end(self.alive_prefix).decode(), self.joins_prefix.encode()),
                (prefix_end(self.joins_prefix).decode(), self.stores_prefix.encode()),
                (prefix_end(self.stores_prefix).decode(), prefix_end(self.base))]

    def parse(self, key: str) -> tuple[str, int | None, str | None]:
        """(kind, round, node) of a membership key; kind "" for keys the protocol does not own."""
        rel = key[len(self.base):] if key.startswith(self.base) else ""
        if rel in ("round", "closed"):
            return rel, None, None
        for kind in ("alive", "waiting"):
            if rel.startswith(kind + "/"):
                return kind, None, rel[len(kind) + 1:]
        parts = rel.split("/")
        if len(parts) == 3 and parts[1].isdigit():
            if parts[0] == "rounds" and parts[2] == "final":
                return "final", int(parts[1]), None
            if parts[0] == "joins":
                return "join", int(parts[1]), parts[2]
        return "", None, None

    @staticmethod
    def decode_round(kv) -> int:
        text = kv.value.decode(errors="replace")
        if not text.isdigit():
            raise RendezvousDataError(
                f"etcd key {kv.key} holds {kv.value[:32]!r}, not a round number; "
                "remove it (`etcdctl del` that key) or use a new --rdzv-id"
            )
        return int(text)
