"""Response header decoding (rendezvous/wire.py): blocks are decoded once per process and shared between
connections, which is sound because every block decoded is one whose bytes mean the same on any connection
(the member's encoder applied this client's header table size of 0)."""

from __future__ import annotations

import hpack
import pytest

from elastic_rt.rendezvous.wire import HeaderDecoder

OK = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def test_a_block_from_an_encoder_that_kept_its_table_is_refused_not_shared():
    sender = hpack.Encoder()  # a member that ignored this client's table size of 0: it indexes what it sends
    block = sender.encode([(b"x-seen", b"once")])
    with pytest.raises(hpack.HPACKError):  # Connection fails the connection with INTERNAL on it
        HeaderDecoder().decode(block)
    with pytest.raises(hpack.HPACKError):  # and nothing of it was kept for another connection
        HeaderDecoder().decode(block)


def test_blocks_after_the_size_update_decode_alike_on_every_connection():
    sender = hpack.Encoder()
    sender.header_table_size = 0  # the member applies this client's SETTINGS_HEADER_TABLE_SIZE of 0
    update = sender.encode(OK)  # opens with the table size update
    plain = sender.encode(OK)
    a, b = HeaderDecoder(), HeaderDecoder()
    assert a.decode(update) == dict(OK)
    assert a.decode(plain) == dict(OK)
    assert b.decode(update) == dict(OK)  # b's own table shrinks only by decoding the update itself
    assert b.decode(plain) == dict(OK)
    assert b.decode(plain) is a.decode(plain)  # one decoded copy, shared


def test_the_size_update_is_applied_without_hpack_and_later_blocks_still_decode():
    """The first block's update to 0 is taken off and applied to hpack's table, so the rest of it is looked up in the
    process's cache; a block not seen before, later, is decoded by hpack, whose table is then the member's."""
    sender = hpack.Encoder()
    sender.header_table_size = 0
    first = sender.encode(OK)
    assert first[:1] == b"\x20"
    HeaderDecoder().decode(first)  # the process has seen the plain block now
    d = HeaderDecoder()
    assert d.decode(first) == dict(OK)
    rare = sender.encode([(b"grpc-status", b"14"), (b"grpc-message", b"etcdserver: leader changed %d" % id(d))])
    assert d.decode(rare) == {b"grpc-status": b"14", b"grpc-message": b"etcdserver: leader changed %d" % id(d)}


def test_an_update_to_a_size_above_zero_is_still_refused():
    sender = hpack.Encoder()
    sender.header_table_size = 100  # above this client's setting of 0
    with pytest.raises(hpack.HPACKError):
        HeaderDecoder().decode(sender.encode(OK))
