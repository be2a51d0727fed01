"""An endpoint records when etcd answered a keep-alive that it timed out ("request timed out, waiting for the applied
index took too long": its leader renews a lease only once it has applied what was committed before, and gives up after
a second). The answer renews nothing and costs the lease nothing (None); the benchmark counts these answers per window
(meet_keepalive_busy) to tell an etcd that fell behind in applying from one that lost a lease some other way."""

from __future__ import annotations

import grpc
import pytest

from elastic_rt.rendezvous.etcd_endpoint import Endpoint
from elastic_rt.rendezvous.wire import CallError


class _Stream:
    """A keep-alive stream whose beat fails with `error`."""

    def __init__(self, metadata, error: CallError) -> None:
        self.metadata, self.error, self.closed = metadata, error, False

    def beat(self, lease_id, timeout_s, silent_s):
        raise self.error

    def close(self) -> None:
        self.closed = True


def _endpoint_failing_with(error: CallError) -> tuple[Endpoint, _Stream]:
    ep = Endpoint("127.0.0.1", 1, None)
    ep.metadata = ()
    ep.keepalive = stream = _Stream(ep.metadata, error)
    return ep, stream


def test_a_keep_alive_etcd_timed_out_is_recorded_and_renews_nothing():
    ep, stream = _endpoint_failing_with(CallError(
        grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out, waiting for the applied index took too long"))
    assert ep.keep_alive(7, timeout_s=1.0) is None
    assert len(ep.busy) == 1 and stream.closed and ep.keepalive is None  # the stream ended: the next beat opens one
    ep.keepalive = _Stream(ep.metadata, stream.error)
    ep.keep_alive(7, timeout_s=1.0)
    assert len(ep.busy) == 2 and ep.busy[0] <= ep.busy[1]


@pytest.mark.parametrize("error", [CallError(grpc.StatusCode.UNAVAILABLE, "connection reset"),
                                   CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in 1.5 s")])
def test_other_failures_are_not_recorded_as_busy(error):
    ep, _ = _endpoint_failing_with(error)
    with pytest.raises(CallError):
        ep.keep_alive(7, timeout_s=1.0)
    assert len(ep.busy) == 0
