"""The console tee (elastic_rt/agent/console_tee.py): a worker line reaches the agent's console whole, behind one
prefix, however its writes and the tail's reads interleave; torch's own tail splits it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading

from torch.distributed.elastic.multiprocessing import tail_log
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from elastic_rt.agent import console_tee
from elastic_rt.agent.console_tee import tail_whole_lines, whole_line_tee


class WriterAtEof:
    """A `finished` event for a tail: each time the tail reads to the end of the file and asks, the next of
    `writes` is appended to the file (the worker writing on), and once they are written the worker is done.
    So the tail reads every part up to the file's end before the next one exists: the interleaving that
    splits lines on a loaded machine, made certain."""

    def __init__(self, path, writes: list[str]) -> None:
        self._path = path
        self._writes = list(writes)
        self.asked = 0

    def is_set(self) -> bool:
        self.asked += 1
        if not self._writes:
            return True
        with open(self._path, "a") as f:
            f.write(self._writes.pop(0))
        return False


def _tail(tail, tmp_path, first: str, writes: list[str], log_line_filter=None) -> str:
    path = tmp_path / "0_stdout.log"
    path.write_text(first)
    out = io.StringIO()
    finished = WriterAtEof(path, writes)
    tail("[default0]:", str(path), out, finished, 0.0, log_line_filter)
    assert finished.asked == len(writes) + 1  # the tail met the file's end before each write
    return out.getvalue()


# print() under PYTHONUNBUFFERED: the text, then the newline; a write cut at a page of the file.
PARTS = ["indices step=2", "4 epoch=0 idx=1,2", "\n", "step=25 loss=0.5", "\n"]


def test_torch_tail_splits_a_line_written_in_parts(tmp_path):
    out = _tail(tail_log.tail_logfile, tmp_path, PARTS[0], PARTS[1:], lambda _: True)
    assert out.splitlines()[0] == "[default0]:indices step=2[default0]:4 epoch=0 idx=1,2[default0]:"


def test_each_line_written_in_parts_reaches_the_console_whole_behind_one_prefix(tmp_path):
    out = _tail(tail_whole_lines, tmp_path, PARTS[0], PARTS[1:])
    assert out == "[default0]:indices step=24 epoch=0 idx=1,2\n[default0]:step=25 loss=0.5\n"


def test_a_last_line_without_newline_is_written_when_the_worker_ends(tmp_path):
    out = _tail(tail_whole_lines, tmp_path, "done steps=3", [" world_size=2"])
    assert out == "[default0]:done steps=3 world_size=2\n"


def test_the_filter_judges_whole_lines(tmp_path):
    """--duplicate-stdout-filters: a needle in the second half of a split line still selects the whole line."""
    out = _tail(tail_whole_lines, tmp_path, "indices step=24 ", ["loss=nan\n", "step=25\n"],
                lambda line: "loss=nan" in line)
    assert out == "[default0]:indices step=24 loss=nan\n"


def test_a_line_longer_than_the_limit_is_written_in_pieces_each_behind_the_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(console_tee, "MAX_LINE_CHARS", 8)
    out = _tail(tail_whole_lines, tmp_path, "abcdef", ["ghijkl\n"])
    assert out.splitlines() == ["[default0]:abcdefgh", "[default0]:ijkl"]


def test_a_file_that_never_appears_ends_the_tail_when_the_worker_is_done(tmp_path):
    finished = threading.Event()
    finished.set()
    out = io.StringIO()
    tail_whole_lines("[default0]:", str(tmp_path / "never.log"), out, finished, 0.0)
    assert out.getvalue() == ""


def test_torch_tail_logs_started_within_the_block_copy_whole_lines(tmp_path):
    """What the agent does around starting a group: torch's TailLog (its --tee) now ends a last partial line."""
    path = tmp_path / "0_stdout.log"
    path.write_text("step=1\nstopped steps=1")
    for patched, want in ((True, "[default0]:step=1\n[default0]:stopped steps=1\n"),
                          (False, "[default0]:step=1\n[default0]:stopped steps=1")):
        out = io.StringIO()
        with whole_line_tee() if patched else contextlib.nullcontext():
            tailer = TailLog("default", {0: str(path)}, out, interval_sec=0.01).start()
        tailer.stop()
        assert out.getvalue() == want
    assert tail_log.tail_logfile is not tail_whole_lines  # torch's again after the block


def test_a_real_unbuffered_writer_lines_all_arrive_whole(tmp_path):
    """A real process printing under PYTHONUNBUFFERED (two writes a line), tailed while it writes."""
    path = tmp_path / "0_stdout.log"
    path.touch()
    out = io.StringIO()
    finished = threading.Event()
    tail = threading.Thread(target=tail_whole_lines, args=("[default0]:", str(path), out, finished, 0.001))
    tail.start()
    code = ("for i in range(3000): print(f'indices step={i} epoch=0 idx=' + ','.join(map(str, range(40))))")
    with open(path, "a") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True, timeout=60,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finished.set()
    tail.join(timeout=60)
    idx = ",".join(map(str, range(40)))
    assert out.getvalue().splitlines() == [f"[default0]:indices step={i} epoch=0 idx={idx}" for i in range(3000)]
