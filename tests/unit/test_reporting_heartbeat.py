"""Step heartbeat: worker-side report_step and the agent-side reader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_rt.worker_reports import heartbeat as hb
from elastic_rt.worker_env import ENV_HEARTBEAT_FILE


class FakeNs:
    def __init__(self, ns: int) -> None:
        self.ns = ns

    def __call__(self) -> int:
        return self.ns


@pytest.fixture(autouse=True)
def _fresh_writer():
    hb.report_to(None)
    yield
    hb.report_to(None)


def test_writer_reader_round_trip_with_age(tmp_path):
    path = str(tmp_path / "w0.hb")
    writer_clock = FakeNs(100 * 10**9)
    w = hb.HeartbeatWriter(path, clock_ns=writer_clock)
    w.report(41)
    writer_clock.ns += 2 * 10**9
    w.report(42)
    beat = hb.read_heartbeat(path, clock=lambda: 105.5)
    assert beat is not None
    assert (beat.step, beat.seq, beat.pid) == (42, 2, os.getpid())
    assert beat.timestamp_s == pytest.approx(102.0)
    assert beat.age_s == pytest.approx(3.5)
    w.close()


def test_reader_clamps_negative_age(tmp_path):
    path = str(tmp_path / "w0.hb")
    w = hb.HeartbeatWriter(path, clock_ns=FakeNs(50 * 10**9))
    w.report(1)
    assert hb.read_heartbeat(path, clock=lambda: 10.0).age_s == 0.0
    w.close()


@pytest.mark.parametrize(
    "content",
    [b"", b"\0" * hb.RECORD_SIZE, b"ERHB\x01", b"garbage that is long enough to be a record!!", os.urandom(64)],
    ids=["empty", "zeros", "short", "text", "random"],
)
def test_reader_returns_none_for_unusable_files(tmp_path, content):
    path = tmp_path / "w0.hb"
    path.write_bytes(content)
    assert hb.read_heartbeat(str(path)) is None


def test_reader_returns_none_for_missing_file_and_directory(tmp_path):
    assert hb.read_heartbeat(str(tmp_path / "absent.hb")) is None
    assert hb.read_heartbeat(str(tmp_path)) is None  # EISDIR


def test_torn_record_fails_checksum(tmp_path):
    path = tmp_path / "w0.hb"
    old = hb.encode_record(pid=1, seq=7, step=700, mono_ns=1)
    new = hb.encode_record(pid=1, seq=8, step=800, mono_ns=2)
    # A reader that saw the first half of the new write and the second half of the old.
    path.write_bytes(new[:16] + old[16:])
    assert hb.read_heartbeat(str(path)) is None
    assert hb.decode_record(new) == (1, 8, 800, 2, 0, 0)


def test_report_step_is_a_noop_without_the_agent(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_HEARTBEAT_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    for step in range(3):
        hb.report_step(step)
    assert list(tmp_path.iterdir()) == []


def test_report_step_writes_the_file_named_by_the_agent(monkeypatch, tmp_path):
    path = tmp_path / "hb" / "w3.hb"
    hb.prepare_heartbeat_file(str(path))
    monkeypatch.setenv(ENV_HEARTBEAT_FILE, str(path))
    assert hb.read_heartbeat(str(path)) is None
    hb.report_step(10)
    hb.report_step(11)
    beat = hb.read_heartbeat(str(path))
    assert (beat.step, beat.seq) == (11, 2)


def test_report_to_moves_the_reports_to_another_file_and_counts_steps_over(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_HEARTBEAT_FILE, raising=False)
    first, second = str(tmp_path / "first.hb"), str(tmp_path / "second.hb")
    for path in (first, second):
        hb.prepare_heartbeat_file(path)
    hb.report_to(first)
    for _ in range(3):
        hb.optimizer_step_hook(object, (), {})  # an optimizer step without a step number
    hb.report_to(second)
    hb.optimizer_step_hook(object, (), {})
    assert (hb.read_heartbeat(first).step, hb.read_heartbeat(second).step) == (3, 1)
    hb.report_to(None)  # back to the environment, which names no file: reports go nowhere
    hb.report_step(50)
    assert hb.read_heartbeat(second).step == 1


def test_report_to_a_file_that_cannot_be_opened_warns_and_training_goes_on(tmp_path, caplog):
    hb.report_to(str(tmp_path / "no-such-dir" / "w0.hb"))
    hb.report_step(1)
    assert "step heartbeats are off" in caplog.text


def test_prepare_removes_a_stale_record(tmp_path):
    path = str(tmp_path / "w0.hb")
    w = hb.HeartbeatWriter(path)
    w.report(5)
    w.close()
    hb.prepare_heartbeat_file(path)
    assert hb.read_heartbeat(path) is None


def test_report_step_from_a_separate_worker_process(tmp_path):
    path = tmp_path / "w0.hb"
    hb.prepare_heartbeat_file(str(path))
    script = "from elastic_rt.worker_reports.heartbeat import report_step\nfor s in range(100): report_step(s)\n"
    env = dict(os.environ, **{ENV_HEARTBEAT_FILE: str(path)})
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert proc.returncode == 0
    beat = hb.read_heartbeat(str(path))
    assert (beat.step, beat.seq) == (99, 100)
    assert beat.pid != os.getpid()


def test_reader_maps_local_ranks(tmp_path):
    paths = {0: str(tmp_path / "0.hb"), 1: str(tmp_path / "1.hb")}
    w = hb.HeartbeatWriter(paths[1])
    w.report(3)
    beats = hb.HeartbeatReader(paths).read()
    assert beats[0] is None and beats[1].step == 3
    w.close()


def test_finish_tells_a_returned_script_from_one_that_raised(tmp_path):
    for returned in (True, False):
        path = str(tmp_path / f"hb-{returned}")
        hb.prepare_heartbeat_file(path)
        writer = hb.HeartbeatWriter(path)
        writer.report(3)
        assert not hb.read_heartbeat(path).finished
        writer.finish(returned)
        beat = hb.read_heartbeat(path)
        writer.close()
        assert beat.finished and beat.returned is returned and beat.step == 3
