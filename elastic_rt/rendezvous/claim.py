"""Whose run this is: the job fingerprint recorded with a run and checked by every node that starts, and the
clean-up by the last agent to leave a finished run (all its keys but a `closed` marker on a lease)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass

from elastic_rt.errors import RunInUseError
from elastic_rt.rendezvous.etcd_client import EtcdClient, IfAbsent, Outcome, Put, RangeRead, prefix_end
from elastic_rt.rendezvous.keys import RunKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class JobFingerprint:
    """What makes two launches the same job: the script, its arguments (as a digest: they may hold paths and
    tokens), --nnodes and the operator's launch id (`--rdzv-conf launch_id=`, e.g. $SLURM_JOB_ID)."""

    script: str
    args_sha256: str
    nnodes: str
    launch_id: str = ""

    @classmethod
    def of(cls, *, script: str, script_args: tuple[str, ...], min_nodes: int, max_nodes: int,
           launch_id: str = "") -> JobFingerprint:
        args = hashlib.sha256(json.dumps(list(script_args)).encode()).hexdigest()[:16]
        nnodes = str(min_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
        return cls(script=os.path.normpath(script) if script else "", args_sha256=args, nnodes=nnodes,
                   launch_id=launch_id)

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: str | bytes) -> JobFingerprint | None:
        try:
            data = json.loads(text)
            return cls(script=str(data["script"]), args_sha256=str(data["args_sha256"]), nnodes=str(data["nnodes"]),
                       launch_id=str(data.get("launch_id", "")))
        except (KeyError, TypeError, ValueError, UnicodeDecodeError):
            return None

    def differences(self, theirs: JobFingerprint | None) -> str:
        """What differs from `theirs`, in words ("the script is a.py, not b.py; the arguments differ")."""
        if theirs is None:
            return "its fingerprint is not elastic-rt's"
        out = []
        if self.script != theirs.script:
            out.append(f"its script is {theirs.script}, not {self.script}")
        if self.args_sha256 != theirs.args_sha256:
            out.append("its script arguments differ")
        if self.nnodes != theirs.nnodes:
            out.append(f"its --nnodes is {theirs.nnodes}, not {self.nnodes}")
        if self.launch_id != theirs.launch_id:
            out.append(f"its launch_id is {theirs.launch_id or '(none)'}, not {self.launch_id or '(none)'}")
        return "; ".join(out) or "its fingerprint differs"


def claim_ahead(keys: RunKeys, fingerprint: str) -> IfAbsent:
    """claim_run's first step, to go in another request (the registration's: NodeLease.start): the fingerprint
    recorded where the run has none, else read. Give claim_run what came of it (`ahead`)."""
    return IfAbsent((keys.fingerprint,), (Put(keys.fingerprint, fingerprint.encode()),),
                    held_read=RangeRead([(keys.fingerprint, b"")]))


def claim_run(client: EtcdClient, keys: RunKeys, fingerprint: str, node_id: str, *,
              ahead: Outcome | None = None) -> None:
    """Record this job's fingerprint with the run, or check it against the one recorded. A different one is
    refused (RunInUseError, one line) while any other agent of the run is alive; with none alive the run was
    left by an earlier job, and this one takes it over (one log line). `ahead`: what claim_ahead() made of it in
    another request (recorded, or found recorded: no request here). Raises EtcdUnavailableError (retried)."""
    mine = fingerprint.encode()
    if ahead is not None:
        made, ranges, _ = ahead
        if made or any(kv.value == mine for kv in ranges[0]):
            return
    expected: int | None = None  # create-only, then over the revision read
    while True:
        ok, kv = client.compare_and_put(keys.fingerprint, mine, expected_mod_revision=expected)
        if ok or (kv is not None and kv.value == mine):
            return
        if kv is None:  # deleted meanwhile (the run's last agent cleaned up): create it
            expected = None
            continue
        alive, _ = client.read_ranges([keys.alive_range], keys_only=frozenset({0}))
        others = sorted(node for node in (keys.parse(a.key)[2] for a in alive[0]) if node and node != node_id)
        theirs = JobFingerprint.decode(kv.value)
        if others:
            ours = JobFingerprint.decode(mine)
            what = ours.differences(theirs) if ours is not None else "its fingerprint differs"
            raise RunInUseError(
                f"run {keys.run_id} belongs to another job whose agents are running ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}): {what}; use another --rdzv-id (two jobs under one id "
                "would train as one world)")
        log.info("node %s: run %s was used by another command before (%s); none of its agents is alive: "
                 "this job takes the run over", node_id, keys.run_id,
                 (JobFingerprint.decode(mine) or theirs).differences(theirs) if theirs else "unknown fingerprint")
        expected = kv.mod_revision


def remove_run_keys(client: EtcdClient, keys: RunKeys) -> int:
    """Delete every key of the run but `closed`, in one transaction that does nothing while any alive/ key is
    left (an agent that came meanwhile keeps the run). Returns the keys deleted (0: not done)."""
    base, closed = keys.base, keys.closed
    return client.delete_ranges_if_empty(
        [(base, closed), (closed + "\0", prefix_end(base).decode())], empty=keys.alive_range)
