"""The membership view's watch answers are applied on the etcd connection's reader thread (WatchStream's on_event):
the view has no thread of its own while its stream works, where it had one that woke for every answer; a thread
opens a stream again (after it broke, a failover, a re-read wanted) and ends once it is open. Answers of a stream
the view replaced are never applied."""

from __future__ import annotations

import contextlib
import threading
import time

from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.view import MembershipView
from tests.support.prometheus import wait_until


def _view_threads(view: MembershipView) -> list[threading.Thread]:
    thread = view._thread  # noqa: SLF001 - the last thread the view started, if any
    return [thread] if thread is not None and thread.is_alive() else []


@contextlib.contextmanager
def _connected_view(etcd_client, run_id):
    """A started view whose stream is open (its creates answered); stopped afterwards."""
    view = MembershipView(etcd_client, RunKeys(run_id), node_id="m")
    view.start()
    try:
        assert view.wait_for(lambda: view.connected, 10)
        yield view
    finally:
        view.stop()


def test_a_working_view_has_no_thread_of_its_own(etcd_client, run_id):
    keys = RunKeys(run_id)
    before = set(threading.enumerate())
    with _connected_view(etcd_client, run_id) as view:
        etcd_client.put(keys.alive("b"), b"{}")
        assert view.wait_for(lambda: "b" in view.alive, 10)
        etcd_client.delete(keys.alive("b"))
        assert view.wait_for(lambda: "b" not in view.alive and "b" in view.departed, 10)
        started = sorted(t.name for t in set(threading.enumerate()) - before)
        assert not any(name.startswith("elastic-rt-view") for name in started), started
        assert view._thread is None  # noqa: SLF001


def test_a_stream_closed_is_opened_again_by_a_thread_that_then_ends(etcd_client, run_id):
    keys = RunKeys(run_id)
    with _connected_view(etcd_client, run_id) as view:
        with view.lock:
            first = view._stream  # noqa: SLF001
        view.reconnect()  # as after a failover
        wait_until("a new stream", lambda: view._stream is not None and view._stream is not first, 10,  # noqa: SLF001
                   poll_s=0.01)  # (opening a stream changes no version: nothing to wait on)
        view._thread.join(10)  # noqa: SLF001
        assert not _view_threads(view)  # the stream is open: the thread that opened it is gone
        etcd_client.put(keys.alive("c"), b"{}")  # the new stream delivers, from the revision the old one reached
        assert view.wait_for(lambda: "c" in view.alive, 10)
        assert view.connected


def test_answers_of_a_replaced_stream_are_not_applied(etcd_client, run_id):
    with _connected_view(etcd_client, run_id) as view:
        with view.lock:
            gen = view._gen  # noqa: SLF001 - the stream now
        view.reconnect()
        wait_until("a new stream", lambda: view._stream is not None and view._gen != gen, 10,  # noqa: SLF001
                   poll_s=0.01)
        with view.lock:
            version = view.version
        view._on_watch(gen, 0, [], False)  # noqa: SLF001 - a late answer of the old stream
        view._on_watch_end(gen, RuntimeError("late"))  # noqa: SLF001 - and its late end
        with view.lock:
            assert view.version == version and view.connected and view._stream is not None  # noqa: SLF001


def test_stop_ends_the_stream_and_leaves_no_thread(etcd_client, run_id):
    keys = RunKeys(run_id)
    view = MembershipView(etcd_client, keys, node_id="m")
    view.start()
    assert view.wait_for(lambda: view.connected, 10)
    view.reconnect()  # a reopen in flight when stop() comes
    view.stop()
    deadline = time.monotonic() + 10
    while _view_threads(view):
        assert time.monotonic() < deadline, "the view's thread outlived stop()"
        time.sleep(0.01)
    with view.lock:
        assert view._stream is None and not view.connected  # noqa: SLF001


def test_a_stream_that_no_thread_could_reopen_is_reopened_at_the_next_revive(etcd_client, run_id, monkeypatch):
    """Its stream ended while the process could start no thread (a thread limit): the view says it is not connected,
    is not left waiting on a recovery that never started, and revive() (the lease thread calls it after every beat)
    reopens it; what changed meanwhile is read."""
    import elastic_rt.rendezvous.view as view_module

    keys = RunKeys(run_id)
    with _connected_view(etcd_client, run_id) as view:
        real = threading.Thread

        class NoThread(real):
            def start(self):
                raise RuntimeError("can't start new thread")

        monkeypatch.setattr(view_module.threading, "Thread", NoThread)
        view.reconnect()  # the stream ends; reopening it needs a thread
        assert view.wait_for(lambda: not view.connected, 10)
        view.revive()  # still no thread: it stays as it is, and says so again
        monkeypatch.setattr(view_module.threading, "Thread", real)
        etcd_client.put(keys.alive("d"), b"{}")  # while no stream was open
        view.revive()
        assert view.wait_for(lambda: view.connected and "d" in view.alive, 10)
        etcd_client.put(keys.alive("e"), b"{}")
        assert view.wait_for(lambda: "e" in view.alive, 10)
