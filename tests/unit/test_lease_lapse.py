"""Whose silence let a lease run out: this process's (no keep-alive sent for a TTL) or etcd's (sent, not renewed)."""

from __future__ import annotations

import pytest

from elastic_rt.rendezvous.lease import SENDS_KEPT, lapse_of


def test_beats_sent_on_schedule_and_not_renewed_blame_etcd():
    lapse = lapse_of(10.0, [9.0, 10.0, 11.0, 12.0, 13.0], at=14.0, ttl_s=3.0)
    assert (lapse.cause, lapse.beats, lapse.unrenewed_s, lapse.longest_silence_s) == ("etcd", 4, 4.0, 1.0)
    assert "4 keep-alives sent in 4.0 s, none more than 1.0 s apart" in lapse.describe()


def test_a_stretch_of_a_ttl_with_no_send_blames_this_process():
    lapse = lapse_of(10.0, [11.0, 15.5], at=16.0, ttl_s=3.0)
    assert (lapse.cause, lapse.longest_silence_s, lapse.beats) == ("process", 4.5, 3)
    assert "sent no keep-alive for 4.5 s (TTL 3 s)" in lapse.describe()


def test_the_silence_after_the_last_renewal_counts_and_so_does_the_one_before_the_gone_answer():
    assert lapse_of(10.0, [13.2, 14.0], at=14.5, ttl_s=3.0).cause == "process"  # none sent for 3.2 s after it
    assert lapse_of(10.0, [11.0], at=14.0, ttl_s=3.0).cause == "process"  # nor for 3 s before the last


def test_the_gone_keep_alive_itself_among_the_sends_is_not_counted_twice():
    lapse = lapse_of(10.0, [11.0, 12.0, 13.0], at=13.0000001, ttl_s=3.0)
    assert lapse.beats == 3 and lapse.longest_silence_s == pytest.approx(1.0)


def test_sends_forgotten_after_the_renewal_say_nothing_of_the_silence_before_them():
    sends = [100.0 + i for i in range(SENDS_KEPT)]  # the first 90 s of sends since the renewal at 10 were dropped
    lapse = lapse_of(10.0, sends, at=100.0 + SENDS_KEPT, ttl_s=3.0)
    assert lapse.cause == "etcd" and lapse.longest_silence_s == 1.0
