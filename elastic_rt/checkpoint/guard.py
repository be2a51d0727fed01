"""The writer's token and the checks before every commit and delete: the writer lease, and the agent's fence."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from typing import Callable, Mapping

from elastic_rt.checkpoint import collectives as coll
from elastic_rt.checkpoint.backends import Storage
from elastic_rt.checkpoint.fence import FenceCheck
from elastic_rt.checkpoint.manifest import WriterToken
from elastic_rt.checkpoint.writer_lease import WriterLease
from elastic_rt.errors import CheckpointError, ElasticRTError
from elastic_rt.worker_env import ENV_RUN_ID

log = logging.getLogger(__name__)

ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class WriterGuard:
    """Rank 0's right to write under a checkpoint root; other ranks hold an inert one (rank 0 decides).

    Token: run id and launch id from the elastic agent's fence (its launch is the etcd `round` key's
    creation), else the run id torchrun gives (or none) and a launch id of this manager's own; the
    round from the agent (0 without one); the epoch from the writer lease. Without an agent the
    fence is the lease alone: the create-only commit, the lease's epoch check and its beat."""

    def __init__(self, *, token: WriterToken, lease: WriterLease | None, fence: FenceCheck | None,
                 fence_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._token, self.lease, self.fence = token, lease, fence
        self._fence_wait_s, self._clock = fence_wait_s, clock
        self.last_check_s = 0.0

    @classmethod
    def acquire(cls, storage: Storage, groups: coll.CheckpointGroups, *, lease_ttl_s: float, wait_s: float,
                fence_wait_s: float) -> "WriterGuard":
        """Every rank at once: rank 0 takes the writer lease (one writer per URL) and tells the others its
        epoch; an error there (another job holds the URL, storage unreachable) is raised on every rank alike."""
        fence = FenceCheck.from_env()
        token = cls.token_from_env(fence)
        lease, outcome = None, None
        if groups.rank == 0:
            lease = WriterLease(storage, token=token, ttl_s=lease_ttl_s, wait_s=wait_s, fenced=fence is not None)
            try:
                outcome = lease.acquire()
            except ElasticRTError as exc:
                outcome = str(exc)
        outcome = coll.broadcast(outcome, groups.ctl)
        if isinstance(outcome, str):
            groups.destroy()
            raise CheckpointError(outcome)
        return cls(token=replace(token, epoch=outcome), lease=lease, fence=fence, fence_wait_s=fence_wait_s)

    @classmethod
    def token_from_env(cls, fence: FenceCheck | None, env: Mapping[str, str] = os.environ) -> WriterToken:
        if fence is not None:
            return WriterToken(run_id=fence.run_id, launch_id=fence.launch_id, round=fence.round)
        run_id = env.get(ENV_RUN_ID) or env.get(ENV_TORCHELASTIC_RUN_ID) or ""
        return WriterToken(run_id=run_id, launch_id=f"pid{os.getpid()}-{uuid.uuid4().hex[:8]}", round=0)

    @property
    def epoch(self) -> int:
        return self.lease.epoch if self.lease is not None else self._token.epoch

    @property
    def token(self) -> WriterToken:
        return WriterToken(run_id=self._token.run_id, launch_id=self._token.launch_id, round=self._token.round,
                           epoch=self.epoch)

    def check(self) -> None:
        """FencedError unless this writer is current: the agent's round (waiting up to fence_wait_s for a
        late confirmation) and the writer lease (held, fresh, no newer epoch)."""
        started = self._clock()
        try:
            if self.fence is not None:
                self.fence.check(wait_s=self._fence_wait_s)
            if self.lease is not None:
                self.lease.check()
        finally:
            self.last_check_s = self._clock() - started

    def check_local(self) -> None:
        """The cheap part of check(), before each delete: the agent's file and the lease's own clock."""
        if self.fence is not None:
            self.fence.check(wait_s=0.0)
        if self.lease is not None:
            self.lease.check(local_only=True)
