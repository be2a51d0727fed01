"""tests/support/rendezvous.together(): a rendezvous that does not finish fails with where each stuck node stands."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.support.rendezvous import together


def test_a_stuck_rendezvous_names_the_node_its_view_and_its_stack(etcd_endpoint, run_id):
    h = create_etcd_v3_handler(RendezvousParameters("etcd-v3", etcd_endpoint, run_id, 2, 2, local_addr="127.0.0.1",
                                                    node_id="lonely", join_timeout=10))
    try:
        with pytest.raises(AssertionError) as raised:
            together([h], timeout_s=2.0)  # a job of 2 nodes with 1: it waits for the other
        message = str(raised.value)
        assert "a rendezvous still running after 2 s" in message
        assert "node lonely: round=0 smallest_alive=None" in message
        assert "next_rendezvous" in message  # the stuck thread's stack
    finally:
        h.leave()
        h.close()
