"""IfAbsent, a transaction nested in another's success branch (the registration's claim and round 0), with IfHeld
nested in its own failure branch (the registration's join of an open round 0): its request is the runtime's encoding
of the same message, and its outcome reads the branches etcd took."""

from pyetcd import etcdrpc

from elastic_rt.rendezvous.etcd_client import IfAbsent, IfHeld, Put, RangeRead

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
    ok, ranges, joined = OPENING.outcome(made)
    assert ok and not joined and [[kv.key for kv in r] for r in ranges] == [["r/joins/0/a", "r/joins/0/m"]]
    held = etcdrpc.TxnResponse(succeeded=False, responses=[
        etcdrpc.ResponseOp(response_range=etcdrpc.RangeResponse(kvs=[_kv(b"r/fp", b"job")]))])
    ok, ranges, joined = OPENING.outcome(held)
    assert not ok and not joined and [[(kv.key, kv.value) for kv in r] for r in ranges] == [[("r/fp", b"job")]]


JOIN = Put("r/joins/0/m", b"{}", 7)
OPEN_OR_JOIN = IfAbsent(("r/round",), (Put("r/round", b"0"), JOIN), held_read=RangeRead([("r/fp", b"")]),
                        otherwise=IfHeld("r/round", b"0", ("r/final/0",), (JOIN,), also=(("r/fp", b"job"),)))


def test_otherwise_is_nested_in_the_failure_branch_after_its_reads():
    held = etcdrpc.TxnRequest(
        compare=[C(result=C.EQUAL, target=C.VALUE, key=b"r/round", value=b"0"),
                 C(result=C.EQUAL, target=C.VALUE, key=b"r/fp", value=b"job"),
                 C(result=C.EQUAL, target=C.CREATE, key=b"r/final/0", create_revision=0)],
        success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"r/joins/0/m", value=b"{}", lease=7))])
    txn = etcdrpc.TxnRequest(
        compare=[C(result=C.EQUAL, target=C.CREATE, key=b"r/round", create_revision=0)],
        success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"r/round", value=b"0")),
                 etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"r/joins/0/m", value=b"{}", lease=7))],
        failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=b"r/fp")),
                 etcdrpc.RequestOp(request_txn=held)])
    assert OPEN_OR_JOIN.txn() == etcdrpc.RequestOp(request_txn=txn).SerializeToString()


def test_the_outcome_says_whether_otherwise_put():
    def failed(inner: bool):
        puts = [etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse())] if inner else []
        return etcdrpc.TxnResponse(succeeded=False, responses=[
            etcdrpc.ResponseOp(response_range=etcdrpc.RangeResponse(kvs=[_kv(b"r/fp", b"job")])),
            etcdrpc.ResponseOp(response_txn=etcdrpc.TxnResponse(succeeded=inner, responses=puts))])

    for inner in (True, False):
        ok, ranges, joined = OPEN_OR_JOIN.outcome(failed(inner))
        assert not ok and joined is inner and [[kv.value for kv in r] for r in ranges] == [[b"job"]]
    made = etcdrpc.TxnResponse(succeeded=True, responses=[
        etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse()), etcdrpc.ResponseOp(response_put=etcdrpc.PutResponse())])
    assert OPEN_OR_JOIN.outcome(made) == (True, [], False)
