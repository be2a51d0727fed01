"""IfAbsent, a transaction nested in another's success branch (the registration's claim and round 0): its request is
the runtime's encoding of the same message, and its outcome reads the branch etcd took."""

from pyetcd import etcdrpc

from elastic_rt.rendezvous.etcd_client import IfAbsent, Put, RangeRead

C = etcdrpc.Compare
OPENING = IfAbsent(("r/round", "r/closed"), (Put("r/round", b"0"), Put("r/joins/0/m", b"{}", 7)),
                   made_read=RangeRead([("r/joins/0/", b"r/joins/00")]), held_read=RangeRead([("r/fp", b"")]))


def _kv(key: bytes, value: bytes):
    return etcdrpc.kv_pb2.KeyValue(key=key, value=value, create_revision=5, mod_revision=5)


def test_the_request_is_the_runtimes():
    absent = [C(result=C.EQUAL, target=C.CREATE, key=k, create_revision=0) for k in (b"r/round", b"r/closed")]
    txn = etcdrpc.TxnRequest(
        compare=absent,
        success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"r/round", value=b"0")),
                 etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"r/joins/0/m", value=b"{}", lease=7)),
                 etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=b"r/joins/0/", range_end=b"r/joins/00"))],
        failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=b"r/fp"))])
    assert OPENING.txn() == etcdrpc.RequestOp(request_txn=txn).SerializeToString()


def test_the_outcome_reads_the_branch_etcd_took():
    made = etcdrpc.TxnResponse(succeeded=True, responses=[
        etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse()), etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse()),
        etcdrpc.ResponseOp(response_range=etcdrpc.RangeResponse(kvs=[_kv(b"r/joins/0/a", b"a"),
                                                                      _kv(b"r/joins/0/m", b"{}")]))])
    ok, ranges = OPENING.outcome(made)
    assert ok and [[kv.key for kv in r] for r in ranges] == [["r/joins/0/a", "r/joins/0/m"]]
    held = etcdrpc.TxnResponse(succeeded=False, responses=[
        etcdrpc.ResponseOp(response_range=etcdrpc.RangeResponse(kvs=[_kv(b"r/fp", b"job")]))])
    ok, ranges = OPENING.outcome(held)
    assert not ok and [[(kv.key, kv.value) for kv in r] for r in ranges] == [[("r/fp", b"job")]]
