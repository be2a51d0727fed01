"""A request's DATA frames (StreamTable._data): one frame when the message fits the windows and a frame, else as many
frames as the windows allow, the rest held until a WINDOW_UPDATE; END_STREAM on the last frame of a stream's end."""

import pytest

from elastic_rt.rendezvous.frames import StreamTable
from elastic_rt.rendezvous.wire import DATA, END_STREAM, frame_head, window_update


class Table(StreamTable):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def _write(self, data: bytes) -> None:
        self.written += data

    def _fail(self, error) -> None:
        raise AssertionError(error)


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, off = [], 0
    while off < len(data):
        length, ftype, flags, sid = frame_head(data, off)
        out.append((ftype, flags, sid, bytes(data[off + 9:off + 9 + length])))
        off += 9 + length
    return out


@pytest.mark.parametrize("end", [True, False])
def test_a_message_that_fits_is_one_frame(end):
    t = Table()
    s = t._new_stream()
    body = b"x" * 1000
    assert frames(t._data(s, body, end)) == [(DATA, END_STREAM if end else 0, s.id, body)]
    assert (t._window, s.send_window) == (65535 - 1000, 65535 - 1000)
    assert not s.pending and s.end_pending is end


def test_a_message_larger_than_a_frame_is_split_and_ends_once():
    t = Table()
    s = t._new_stream()
    body = bytes(range(256)) * 100  # 25,600 bytes: two frames of at most 16,384
    out = frames(t._data(s, body, True))
    assert [len(p) for _, _, _, p in out] == [16384, 25600 - 16384]
    assert [f for _, f, _, _ in out] == [0, END_STREAM]
    assert b"".join(p for *_, p in out) == body


def test_a_message_beyond_the_window_waits_for_an_update_and_keeps_its_end():
    t = Table()
    s = t._new_stream()
    s.send_window = 100
    body = b"y" * 300
    first = frames(t._data(s, body, True))
    assert first == [(DATA, 0, s.id, b"y" * 100)] and bytes(s.pending) == b"y" * 200
    more = frames(t._data(s, b"z", False))  # queued behind the held bytes, not sent ahead of them
    assert more == [] and bytes(s.pending) == b"y" * 200 + b"z"
    t._frame(8, 0, s.id, window_update(s.id, 1000)[9:])  # WINDOW_UPDATE for the stream
    assert frames(bytes(t.written)) == [(DATA, END_STREAM, s.id, b"y" * 200 + b"z")]


def test_an_empty_message_with_no_end_writes_nothing():
    t = Table()
    s = t._new_stream()
    assert t._data(s, b"", False) == b""
