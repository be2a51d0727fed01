"""pb.py's hand-encoded requests are byte for byte the protobuf runtime's serialization of the same messages."""

from hypothesis import given, settings
from hypothesis import strategies as st
from pyetcd import etcdrpc

from elastic_rt.rendezvous import pb

keys = st.binary(max_size=300)  # past 127 bytes a length takes two bytes
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
revisions = st.one_of(st.integers(min_value=0, max_value=300), ints)
C = etcdrpc.Compare


def _same(encoded: bytes, message) -> None:
    assert encoded == message.SerializeToString()


@settings(max_examples=300, deadline=None)
@given(keys, revisions)
def test_compares_of_revisions(key, rev):
    _same(pb.compare_created(key, rev), C(result=C.EQUAL, target=C.CREATE, key=key, create_revision=rev))
    _same(pb.compare_mod(key, rev), C(result=C.EQUAL, target=C.MOD, key=key, mod_revision=rev))


@settings(max_examples=300, deadline=None)
@given(keys, keys, revisions, keys)
def test_compares_of_values_and_versions(key, value, version, end):
    _same(pb.compare_value(key, value), C(result=C.EQUAL, target=C.VALUE, key=key, value=value))
    _same(pb.compare_version(key, version, end),
          C(result=C.EQUAL, target=C.VERSION, key=key, version=version, range_end=end))


def test_a_key_that_must_be_absent_says_so():
    """create_revision 0 is a oneof member: written although it is the default (etcd would otherwise compare the
    key's version, and an absent key has version 0 too, but that is not what was asked)."""
    assert pb.compare_created(b"k") == b"\x10\x01\x1a\x01k\x28\x00"


@settings(max_examples=300, deadline=None)
@given(keys, keys, st.integers(min_value=0, max_value=5), st.booleans(), ints)
def test_request_ops(key, end, limit, keys_only, lease):
    _same(pb.range_op(key, end, limit=limit, keys_only=keys_only), etcdrpc.RequestOp(
        request_range=etcdrpc.RangeRequest(key=key, range_end=end, limit=limit, keys_only=keys_only)))
    _same(pb.put_op(key, end, lease), etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=end, lease=lease)))
    _same(pb.delete_op(key, end), etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key,
                                                                                                    range_end=end)))


def test_an_empty_op_is_still_an_op():
    """A RequestOp's request is a oneof member: an all-default one is written (empty), not left out."""
    _same(pb.range_op(b""), etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest()))
    _same(pb.put_op(b"", b""), etcdrpc.RequestOp(request_put=etcdrpc.PutRequest()))


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, max_size=4), st.lists(keys, max_size=6), st.lists(keys, max_size=6), revisions)
def test_transactions_nested_and_not(cmp_keys, put_keys, get_keys, rev):
    compares = [pb.compare_mod(k, rev) for k in cmp_keys]
    success = [pb.put_op(k, k + b"v", 7) for k in put_keys] + [pb.range_op(k) for k in get_keys]
    failure = [pb.range_op(k, b"\0", keys_only=True) for k in get_keys]
    inner = pb.txn(compares, success, failure)
    outer = pb.txn([pb.compare_created(b"x")], [pb.txn_op(inner), *success], failure)

    def msg(cmp_keys):
        return etcdrpc.TxnRequest(
            compare=[C(result=C.EQUAL, target=C.MOD, key=k, mod_revision=rev) for k in cmp_keys],
            success=[*(etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k, value=k + b"v", lease=7)) for k in put_keys),
                     *(etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k)) for k in get_keys)],
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k, range_end=b"\0", keys_only=True))
                     for k in get_keys])

    expected_inner = msg(cmp_keys)
    _same(inner, expected_inner)
    expected = msg([])
    expected.compare.append(C(result=C.EQUAL, target=C.CREATE, key=b"x", create_revision=0))
    expected.success.insert(0, etcdrpc.RequestOp(request_txn=expected_inner))
    _same(outer, expected)


@settings(max_examples=300, deadline=None)
@given(ints, ints)
def test_leases(ttl, lease_id):
    _same(pb.lease_grant(ttl, lease_id), etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id))
    _same(pb.lease_keep_alive(lease_id), etcdrpc.LeaseKeepAliveRequest(ID=lease_id))


def test_a_large_value_takes_a_multibyte_length():
    value = b"v" * 40_000
    _same(pb.put_op(b"k", value), etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=b"k", value=value)))


@settings(max_examples=300, deadline=None)
@given(keys, keys, ints, st.booleans())
def test_watch_creates(key, end, rev, no_put):
    W = etcdrpc.WatchCreateRequest
    _same(pb.watch_create(key, end, rev, no_put=no_put), etcdrpc.WatchRequest(create_request=W(
        key=key, range_end=end, start_revision=rev, filters=[W.NOPUT] if no_put else [])))
