"""Failure causes from what the agent can see: exit status, error file, OOM evidence, backend messages."""

from __future__ import annotations

import json
import signal

import pytest
from prometheus_client import CollectorRegistry

from elastic_rt.diagnostics.failures import (
    CAUSES,
    ErrorRecord,
    classify,
    collective_error,
    describe,
    read_error_file,
    stderr_tail,
    user_frame,
)
from elastic_rt.diagnostics.oom import CgroupOomCounters, KernelLog, OomEvidence
from elastic_rt.worker.main import record_error
from elastic_rt.diagnostics.failure_metrics import FailureMetrics

LIBS = ("/usr/lib/python3.11/", "/venv/site-packages/", "/src/elastic_rt/")
CALLSTACK = '''Traceback (most recent call last):
  File "/src/elastic_rt/worker/main.py", line 105, in main
    runpy.run_path(script, run_name="__main__")
  File "<frozen runpy>", line 291, in run_path
  File "/jobs/train.py", line 77, in <module>
    main()
  File "/jobs/train.py", line 60, in main
    step(batch)
  File "/jobs/model.py", line 12, in step
    torch.nn.functional.linear(x, w)
  File "/venv/site-packages/torch/nn/functional.py", line 900, in linear
    raise RuntimeError("shape mismatch")
RuntimeError: shape mismatch
'''
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 3000ms for recv operation to complete")
GLOO_PEER = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[127.0.0.1]:49064: Connection reset by peer. This is typically caused by a remote worker hanging")
NCCL_WATCHDOG = ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: "
                 "WorkNCCL(SeqNum=57, OpType=ALLREDUCE, NumelIn=1024, Timeout(ms)=600000) ran for 600035 milliseconds")
NCCL_ABORT = "DistBackendError: NCCL communicator was aborted on rank 3."


def test_user_frame_is_the_innermost_frame_outside_libraries():
    assert user_frame(CALLSTACK, LIBS) == "model.py:12 in step"
    only_libs = 'Traceback (most recent call last):\n  File "/venv/site-packages/x.py", line 3, in f\nE: x\n'
    assert user_frame(only_libs, LIBS) == "x.py:3 in f"  # nothing else: the innermost at all
    assert user_frame("no traceback", LIBS) == ""


def test_user_frame_reads_the_last_traceback_of_a_chain():
    chained = CALLSTACK + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        'Traceback (most recent call last):\n  File "/jobs/train.py", line 99, in cleanup\n    x()\nKeyError: 1\n'
    assert user_frame(chained, LIBS) == "train.py:99 in cleanup"


def test_exception_with_frame():
    cause = classify(exitcode=1, error=ErrorRecord(message="RuntimeError: shape mismatch", callstack=CALLSTACK),
                     library_dirs=LIBS)
    assert (cause.cause, cause.frame) == ("exception", "model.py:12 in step")
    assert describe(cause) == "cause=exception: RuntimeError: shape mismatch at model.py:12 in step"


@pytest.mark.parametrize("message,cause,coll", [
    (GLOO_TIMEOUT, "collective_timeout", ("gloo", "timeout")),
    (GLOO_PEER, "collective_error", ("gloo", "peer_closed")),
    (NCCL_WATCHDOG, "collective_timeout", ("nccl", "timeout")),
    (NCCL_ABORT, "collective_error", ("nccl", "abort")),
    ("MemoryError: ", "oom", None),
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", None),
    ("KeyError: 'x'", "exception", None),
])
def test_error_file_messages(message, cause, coll):
    got = classify(exitcode=1, error=ErrorRecord(message=message))
    assert (got.cause, got.collective) == (cause, coll)


def test_an_error_file_wins_over_the_abort_at_teardown():
    # gloo's process group aborts the interpreter at exit after a collective error
    got = classify(exitcode=-int(signal.SIGABRT), error=ErrorRecord(message=GLOO_TIMEOUT))
    assert got.cause == "collective_timeout"


@pytest.mark.parametrize("exitcode,oom,stderr,dumped,cause,detail", [
    (-9, None, "", False, "killed", "SIGKILL from outside the agent"),
    (-15, None, "", False, "killed", "SIGTERM from outside the agent"),
    (-9, "kernel log: Killed process 42", "", False, "oom", "SIGKILL by the kernel OOM killer (kernel log"),
    (-11, None, "", False, "signal", "SIGSEGV"),
    (-7, None, "", False, "signal", "SIGBUS"),
    (-6, None, "terminate called\n" + NCCL_WATCHDOG + "\n", False, "collective_timeout", "SIGABRT after: [PG ID 0"),
    (-6, None, "", True, "collective_timeout", "SIGABRT after NCCL's watchdog dumped"),
    (-6, None, "", False, "signal", "SIGABRT"),
    (139, None, "", False, "signal", "SIGSEGV (exit code 139: killed under a shell)"),
    (3, None, "", False, "exit", "exit code 3 without an exception"),
    (1, None, GLOO_TIMEOUT, False, "collective_timeout", "exit code 1 after: RuntimeError"),
])
def test_exit_status_and_evidence(exitcode, oom, stderr, dumped, cause, detail):
    got = classify(exitcode=exitcode, oom_evidence=oom, stderr_tail=stderr, watchdog_dumped=dumped)
    assert got.cause == cause and got.detail.startswith(detail), got


def test_collective_error_needs_the_backends_words():
    assert collective_error("ValueError: timed out waiting for the user") is None
    assert collective_error(GLOO_TIMEOUT) == ("gloo", "timeout")


def test_error_file_round_trip_in_torchs_format(tmp_path):
    path = str(tmp_path / "error.json")
    try:
        raise ValueError("boom")
    except ValueError as exc:
        record_error(exc, path)
    data = json.loads(open(path).read())
    assert data["message"]["message"] == "ValueError: boom"  # what torch's ProcessFailure reads
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    rec = read_error_file(path)
    assert rec.exc_type == "ValueError" and 'raise ValueError("boom")' in rec.callstack
    try:
        raise KeyError("second")
    except KeyError as exc:
        record_error(exc, path)  # the script's own @record wrote first: left alone
    assert read_error_file(path).message == "ValueError: boom"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=path)
    assert failure.message["message"] == "ValueError: boom"


def test_unreadable_error_files(tmp_path):
    assert read_error_file(None) is None and read_error_file("<N/A>") is None
    (tmp_path / "e").write_text("{torn")
    assert read_error_file(str(tmp_path / "e")) is None
    (tmp_path / "s").write_text(json.dumps({"message": "plain text", "timestamp": 1}))
    assert read_error_file(str(tmp_path / "s")).message == "plain text"


def test_stderr_tail_reads_the_end(tmp_path):
    p = tmp_path / "stderr.log"
    p.write_text("x" * 50000 + "\nlast line\n")
    assert stderr_tail(str(p), max_bytes=100).endswith("last line\n")
    assert stderr_tail("") == "" and stderr_tail(str(tmp_path / "none")) == ""


KMSG = (b"6,420,579317372,-;Tasks state (memory values in pages):\n",
        b"6,423,579317407,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        b"oom_memcg=/job/er,task_memcg=/job/er,task=python3,pid=15952,uid=0\n",
        b"3,424,579317435,-;Memory cgroup out of memory: Killed process 15952 (python3) total-vm:119004kB\n")


def test_kernel_log_names_the_killed_pid(tmp_path):
    path = tmp_path / "kmsg"
    path.write_bytes(b"".join(KMSG))
    klog = KernelLog(str(path), skip_existing=False)
    assert klog.available
    assert "15952" in klog.oom_killed(15952)
    assert klog.oom_killed(1) is None
    klog.close()
    assert not KernelLog(str(tmp_path / "missing")).available


def fake_cgroup(tmp_path, pid: int, proc_line: str, counter_rel: str, content: str):
    proc = tmp_path / "proc" / str(pid)
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(proc_line)
    counter = tmp_path / "cg" / counter_rel
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(content)
    return CgroupOomCounters(cgroup_root=str(tmp_path / "cg"), proc_root=str(tmp_path / "proc")), counter


@pytest.mark.parametrize("proc_line,counter_rel,template", [
    ("0::/job/er\n", "job/er/memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill {n}\n"),
    ("4:memory:/job/er\n0::/\n", "memory/job/er/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"),
])
def test_cgroup_counters_v2_and_v1(tmp_path, proc_line, counter_rel, template):
    counters, counter = fake_cgroup(tmp_path, 77, proc_line, counter_rel, template.format(n=2))
    counters.snapshot(77)
    assert counters.increased(77) is None
    counter.write_text(template.format(n=3))
    assert counters.increased(77).endswith("oom_kill 2 -> 3")
    evidence = OomEvidence(kernel_log=KernelLog(str(tmp_path / "no-kmsg")), cgroups=counters, sleep=lambda s: None)
    assert evidence.for_pid(77).startswith("cgroup ")
    assert evidence.for_pid(78) is None


def test_failure_metrics_count_causes():
    reg = CollectorRegistry()
    m = FailureMetrics(registry=reg, run_id="r", node="n")
    base = {"run_id": "r", "node": "n"}
    for cause in CAUSES:
        assert reg.get_sample_value("elastic_rt_worker_failures_total", {**base, "cause": cause}) == 0
    m.on_failure("collective_timeout", ("nccl", "timeout"))
    m.on_hang(1, "stopped")
    assert reg.get_sample_value("elastic_rt_worker_failures_total", {**base, "cause": "collective_timeout"}) == 1
    assert reg.get_sample_value("elastic_rt_collective_errors_total",
                                {**base, "backend": "nccl", "kind": "timeout"}) == 1
    assert reg.get_sample_value("elastic_rt_worker_failures_total", {**base, "cause": "hang"}) == 1
    assert reg.get_sample_value("elastic_rt_hangs_total",
                                {**base, "local_rank": "1", "process_state": "stopped"}) == 1
    with pytest.raises(ValueError):
        m.on_failure("gremlins")
