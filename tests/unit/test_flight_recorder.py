"""The flight recorder summary over dumps in torch's formats (JSON from _dump_fr_trace_json, NCCL's pickle)."""

from __future__ import annotations

import json
import os
import pickle

from elastic_rt.diagnostics import flight_recorder as fr


def entry(seq: int, *, name: str = "nccl:all_reduce", state: str = "completed", pg: int = 0) -> dict:
    # the keys torch 2.13 writes (FlightRecorder::dump_json / dump pickle)
    return {"record_id": seq - 1, "pg_id": pg, "process_group": [str(pg), "default_pg"], "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": 1_000 * seq,
            "input_sizes": [[1024]], "input_dtypes": ["Float"], "output_sizes": [[1024]],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": 0,
            "time_discovered_completed_ns": 0, "retired": state == "completed", "timeout_ms": 600000,
            "is_p2p": False, "thread_id": "1", "thread_name": "python",
            "frames": [{"name": "all_reduce", "filename": "/venv/site-packages/torch/distributed/distributed_c10d.py",
                        "line": 3245}, {"name": "step", "filename": "/jobs/train.py", "line": 40}]}


def dump(last_enqueued: int, last_completed: int, *, as_strings: bool = True) -> dict:
    entries = [entry(s, state="completed" if s <= last_completed else "started") for s in range(1, last_enqueued + 1)]
    conv = str if as_strings else int  # the JSON dump writes pg_status numbers as strings
    return {"version": "2.10", "comm_lib_version": "2.27.3",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
            "pg_status": {"0": {"last_enqueued_collective": conv(last_enqueued),
                                "last_started_collective": conv(last_enqueued),
                                "last_completed_collective": conv(last_completed)}},
            "entries": entries}


def test_names_the_pending_collective_and_the_ranks_that_had_not_joined():
    dumps = {0: dump(58, 57), 1: dump(57, 57), 2: dump(58, 57)}
    assert fr.summarise(dumps) == ("pg 0 #58 nccl:all_reduce sizes [[1024]] from train.py:40 in step: "
                                   "joined by ranks [0, 2], not joined by ranks [1]")


def test_ranks_without_a_dump_are_named():
    got = fr.summarise({0: dump(12, 11, as_strings=False)}, expected_ranks=[0, 1])
    assert got.endswith("joined by ranks [0]; no dump from ranks [1]")
    assert fr.summarise({}, expected_ranks=[0]) == "no dumps; no dump from ranks [0]"
    assert fr.summarise({0: dump(5, 5), 1: dump(5, 5)}) == "no collective pending"


def test_without_pg_status_the_entries_tell():
    d0, d1 = dump(9, 8), dump(8, 8)
    for d in (d0, d1):
        del d["pg_status"]
    assert "pg 0 #9 nccl:all_reduce" in fr.summarise({0: d0, 1: d1})
    assert "not joined by ranks [1]" in fr.summarise({0: d0, 1: d1})


def test_loads_json_and_plain_pickles_and_refuses_anything_else(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(dump(3, 3)))
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps(dump(3, 2, as_strings=False)))
    (tmp_path / "evil").write_bytes(pickle.dumps({"entries": [os.getcwd]}))  # refers to a global: posix.getcwd
    assert fr.load_dump(str(tmp_path / "a.json"))["version"] == "2.10"
    assert fr.load_dump(str(tmp_path / "nccl_trace_rank_1"))["pg_status"]["0"]["last_completed_collective"] == 2
    assert fr.load_dump(str(tmp_path / "evil")) is None
    assert fr.load_dump(str(tmp_path / "missing")) is None


def test_timeout_dumps_are_nccls_files_written_since_the_workers_started(tmp_path):
    for rank in (0, 3):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(b"x")
    (tmp_path / "nccl_trace_rank_5.tmp").write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    os.utime(tmp_path / "nccl_trace_rank_0", (100, 100))
    assert fr.timeout_dumps(str(tmp_path), since_wall_s=1000) == {3: str(tmp_path / "nccl_trace_rank_3")}
    assert fr.timeout_dumps(str(tmp_path / "none"), 0) == {}


def test_worker_env_turns_it_on_but_leaves_the_users_settings():
    assert fr.worker_env("/logs/fr", {}, fr_names=False) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/logs/fr/nccl_trace_rank_"}
    assert fr.worker_env("/logs/fr", {}) == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/logs/fr/nccl_trace_rank_"}
    assert fr.uses_fr_names("2.13.0+cpu") and fr.uses_fr_names("3.0") and not fr.uses_fr_names("2.9.1")
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_FR_DUMP_TEMP_FILE": "/mine/x"}
    assert fr.worker_env("/logs/fr", mine) == {}
    assert fr.enabled({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) and not fr.enabled(mine) and not fr.enabled({})


def test_listener_answers_through_its_fifo(tmp_path):
    fifo = str(tmp_path / "fr-0.fifo")
    thread = fr.start_dump_listener(fifo, dump=lambda: json.dumps(dump(4, 3)).encode())
    assert thread is not None and thread.daemon
    target = str(tmp_path / "out.json")
    written = fr.request_dumps({fifo: target, str(tmp_path / "nobody.fifo"): str(tmp_path / "x.json")}, wait_s=10)
    assert written == {fifo: target}
    assert fr.summarise({0: fr.load_dump(target)}).startswith("pg 0 #4 nccl:all_reduce")
