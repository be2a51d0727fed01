"""The agent's loop threads (daemon.py): started at once, joined with a deadline, known to themselves, and an
exception that escapes one is logged, not lost. Real threads."""

from __future__ import annotations

import logging
import os
import threading

from elastic_rt.rendezvous.daemon import Daemon, running, thread_name


def test_runs_its_target_and_join_returns_once_it_returned():
    release, seen = threading.Event(), []

    def body() -> None:
        seen.append(d.is_current())
        release.wait(10)

    d = Daemon(body, "t-body")
    assert d.join(0) and not d.is_alive()  # not started: nothing to wait for
    d.start()
    assert not d.join(0.05)  # still running: the deadline passes
    assert d.is_alive() and not d.is_current()
    release.set()
    assert d.join(10)
    assert not d.is_alive()
    assert seen == [True]  # is_current() held on the thread itself, even when it ran before start() returned
    assert d.join(0) and d.join(None)  # joining again returns at once
    assert d.ident is None and not d.is_current()  # an ident is reused at once: a later thread is not this one


def test_its_kernel_thread_id_is_in_proc_while_it_runs():
    release, started = threading.Event(), threading.Event()

    def body() -> None:
        started.set()
        release.wait(10)

    d = Daemon(body, "t-proc").start()
    try:
        assert started.wait(10)
        assert d.native_id is not None and d.native_id != threading.get_native_id()
        assert os.path.exists(f"/proc/self/task/{d.native_id}/status")
    finally:
        release.set()
        assert d.join(10)
    assert d not in running()


def test_a_thread_cannot_wait_for_its_own_end():
    out = []
    d = Daemon(lambda: out.append(d.join(5)), "t-self")
    d.start()
    assert d.join(10)
    assert out == [False]


def test_an_escaping_exception_is_logged_with_the_threads_name_and_ends_it(caplog):
    def body() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="elastic_rt.rendezvous.daemon"):
        d = Daemon(body, "t-fails").start()
        assert d.join(10)
    assert not d.is_alive()
    failed = [r for r in caplog.records if "t-fails" in r.getMessage()]
    assert failed and failed[0].exc_info and "boom" in str(failed[0].exc_info[1])


def test_thread_name_names_a_running_daemon_and_any_other_thread():
    release, named, names = threading.Event(), threading.Event(), []

    def body() -> None:
        names.append(thread_name())
        named.set()
        release.wait(10)

    d = Daemon(body, "t-named").start()
    try:
        assert named.wait(10)
        assert names == ["t-named"]
        assert d in running()
        assert thread_name() == threading.current_thread().name  # not a Daemon: threading's own name
    finally:
        release.set()
        assert d.join(10)
    assert d not in running()
