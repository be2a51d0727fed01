"""Whose silence let a lease run out: etcd's (keep-alives sent on time, not renewed), or this process's (none sent for
a TTL), and then why: the lease thread woke late (the process did not run) or was held elsewhere."""

from __future__ import annotations

import pytest

from elastic_rt.rendezvous.lease import SENDS_KEPT, Send, lapse_of


def _sends(*times: float) -> list[Send]:
    return [Send(t) for t in times]


def test_beats_sent_on_schedule_and_not_renewed_blame_etcd():
    lapse = lapse_of(10.0, _sends(9.0, 10.0, 11.0, 12.0, 13.0, 14.0), at=14.0, ttl_s=3.0)
    assert (lapse.cause, lapse.beats, lapse.unrenewed_s, lapse.longest_silence_s) == ("etcd", 4, 4.0, 1.0)
    assert "4 keep-alives sent in 4.0 s, none more than 1.0 s apart" in lapse.describe()


def test_a_stretch_of_a_ttl_with_no_send_after_a_late_wake_up_blames_the_process():
    sends = [Send(11.0, after_s=0.1), Send(15.5, late_s=3.4, before_s=0.01), Send(16.0)]
    lapse = lapse_of(10.0, sends, at=16.0, ttl_s=3.0)
    assert (lapse.cause, lapse.longest_silence_s, lapse.beats, lapse.late_s) == ("process", 4.5, 3, 3.4)
    assert lapse.held_s == pytest.approx(0.11)
    assert "sent no keep-alive for 4.5 s (TTL 3 s): it woke 3.4 s late" in lapse.describe()


def test_a_stretch_of_a_ttl_spent_in_a_beats_callbacks_or_the_locks_blames_the_lease_thread():
    sends = [Send(11.0, after_s=3.2), Send(15.0, late_s=0.0, before_s=0.6)]
    lapse = lapse_of(10.0, sends, at=15.0, ttl_s=3.0)
    assert lapse.cause == "held" and lapse.held_s == pytest.approx(3.8)
    assert "its lease thread was held 3.8 s" in lapse.describe()


def test_the_silence_after_the_last_renewal_counts_and_so_does_the_one_before_the_gone_answer():
    assert lapse_of(10.0, _sends(13.2, 14.0), at=14.0, ttl_s=3.0).longest_silence_s == pytest.approx(3.2)
    assert lapse_of(10.0, _sends(11.0, 14.0), at=14.0, ttl_s=3.0).longest_silence_s == 3.0


def test_the_gone_keep_alive_is_the_last_send_recorded_before_it_went_out():
    lapse = lapse_of(10.0, _sends(11.0, 12.0, 12.9996), at=13.0, ttl_s=3.0)  # recorded just before the wire saw it
    assert lapse.beats == 3 and lapse.at == 12.9996 and lapse.longest_silence_s == pytest.approx(1.0, abs=1e-3)
    unrecorded = lapse_of(10.0, [], at=10.5, ttl_s=3.0)  # e.g. a grant's first keep-alive
    assert unrecorded.cause == "etcd" and unrecorded.beats == 1


def test_sends_forgotten_after_the_renewal_say_nothing_of_the_silence_before_them():
    sends = _sends(*(100.0 + i for i in range(SENDS_KEPT)))  # the first 90 s of sends since the renewal at 10 dropped
    lapse = lapse_of(10.0, sends, at=100.0 + SENDS_KEPT - 1, ttl_s=3.0)
    assert lapse.cause == "etcd" and lapse.longest_silence_s == 1.0


def test_the_time_spent_after_the_confirmed_keep_alive_counts_as_held():
    """The beat that renewed the lease last, then stuck 3.5 s in its callbacks: the lease thread, not the process."""
    sends = [Send(9.9995, after_s=3.5), Send(14.0)]
    lapse = lapse_of(10.0, sends, at=14.0, ttl_s=3.0)
    assert lapse.cause == "held" and lapse.held_s == 3.5 and lapse.longest_silence_s == 4.0
    stale = [Send(8.0, after_s=3.5), Send(14.0)]  # not the confirmed one (a grant renewed at 10): says nothing
    assert lapse_of(10.0, stale, at=14.0, ttl_s=3.0).cause == "unexplained"


def test_a_silence_that_neither_a_late_wake_up_nor_a_held_thread_explains_is_said_to_be_unexplained():
    lapse = lapse_of(10.0, [Send(11.0, after_s=0.05), Send(14.5, late_s=0.3, before_s=0.01)], at=14.5, ttl_s=3.0)
    assert lapse.cause == "unexplained"
    assert "woke 0.3 s late, was held 0.1 s and backed off 0.0 s, which does not explain it" in lapse.describe()


def test_a_stretch_the_lease_thread_spent_backing_off_after_a_failed_beat_blames_the_backoff():
    lapse = lapse_of(10.0, [Send(11.0, after_s=0.5), Send(14.5, backoff_s=2.0)], at=14.5, ttl_s=3.0)
    assert lapse.cause == "backoff" and lapse.backoff_s == 2.0 and lapse.held_s == 0.5
    assert "waited 2.0 s, backing off after a beat etcd did not answer (and 0.5 s in beats)" in lapse.describe()


def test_a_lapse_found_by_another_thread_while_the_lease_thread_is_stuck_in_a_beat_blames_the_lease_thread():
    """The beat's time after its send is known only when the beat ends; a lapse found meanwhile (the rendezvous saw
    'lease not found') counts how long the lease thread has been in that beat."""
    sends = [Send(10.9, after_s=0.0), Send(15.0)]  # 15.0: the other thread's keep-alive
    assert lapse_of(10.0, sends, at=15.0, ttl_s=3.0).cause == "unexplained"
    lapse = lapse_of(10.0, sends, at=15.0, ttl_s=3.0, stuck_s=4.0)
    assert lapse.cause == "held" and "its lease thread was held 4.0 s" in lapse.describe()
