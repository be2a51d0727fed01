"""torch's collective flight recorder: turned on in workers, dumps collected on a hang or timeout, summarised in one line.

The recorder keeps the last N collectives of every process group in each worker
(NCCL, and gloo in torch >= 2.7). On CUDA elastic-rt turns it on by default
(--flight-recorder auto) through torch's own environment variables, set only where
the user did not set them (torch >= 2.11 renamed the first and the last to TORCH_FR_BUFFER_SIZE
and TORCH_FR_DUMP_TEMP_FILE and warns about the old names; the names torch reads are used):
  TORCH_NCCL_TRACE_BUFFER_SIZE=2000      entries kept per worker
  TORCH_NCCL_DUMP_ON_TIMEOUT=1           NCCL's watchdog writes a dump before it aborts
  TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<log dir>/flight_recorder/nccl_trace_rank_   (+ rank)
On a hang the agent also asks each worker for a dump (a thread in the worker, started
when the script imports torch (which imports torch.distributed), answers through a FIFO and calls
torch._C._distributed_c10d._dump_fr_trace_json()).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger(__name__)

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # (torch >= 2.11, older)
DUMP_FILE_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FR_NAMES_SINCE = (2, 11)
DEFAULT_BUFFER = "2000"
NCCL_DUMP_PREFIX = "nccl_trace_rank_"
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.json)?$")


def uses_fr_names(torch_version: str) -> bool:
    """Whether this torch reads TORCH_FR_* (and warns about the TORCH_NCCL_* names)."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= FR_NAMES_SINCE


def worker_env(directory: str, environ: Mapping[str, str], *, fr_names: bool = True) -> dict[str, str]:
    """The variables that turn the recorder on in workers; those the user set are left alone."""
    pick = 0 if fr_names else 1
    out: dict[str, str] = {}
    if not any(environ.get(k) for k in BUFFER_ENV):
        out[BUFFER_ENV[pick]] = DEFAULT_BUFFER
    if not environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT"):
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not any(environ.get(k) for k in DUMP_FILE_ENV):
        out[DUMP_FILE_ENV[pick]] = os.path.join(directory, NCCL_DUMP_PREFIX)
    return out


def enabled(environ: Mapping[str, str]) -> bool:
    for key in BUFFER_ENV:
        value = environ.get(key, "")
        if value.isdigit():
            return int(value) > 0
    return False


def fifo_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"fr-{local_rank}.fifo")


# ---- worker side -------------------------------------------------------------------------
def start_dump_listener(path: str, dump: Callable[[], bytes] | None = None) -> threading.Thread | None:
    """Serve dump requests: the agent writes '<output path>\\n' into the FIFO at `path`; this thread
    writes the recorder's JSON there. The thread blocks in read(2) and costs nothing until asked."""
    if dump is None:
        from elastic_rt.torch_seams import flight_recorder_dump

        dump = flight_recorder_dump()
        if dump is None:  # a torch without distributed support or without the recorder
            return None
    try:
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # O_RDWR: never EOF when the agent closes its end
    except OSError as exc:
        log.debug("flight recorder dump listener unavailable: %s", exc)
        return None

    def serve() -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                target = line.decode("utf-8", "replace").strip()
                if target:
                    _write_dump(target, dump)

    thread = threading.Thread(target=serve, name="elastic-rt-flight-recorder", daemon=True)
    thread.start()
    return thread


def _write_dump(target: str, dump: Callable[[], bytes]) -> None:
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        data = dump()
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except Exception as exc:  # never let the listener take the worker down
        log.debug("flight recorder dump to %s failed: %s", target, exc)


# ---- agent side --------------------------------------------------------------------------
def request_dumps(requests: Mapping[str, str], *, wait_s: float = 3.0, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, str]:
    """Ask workers for dumps ({fifo: output path}); wait up to wait_s; {fifo: output path} of those written."""
    sent: dict[str, str] = {}
    for fifo, target in requests.items():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # ENXIO: nobody listens
        except OSError:
            continue
        try:
            os.write(fd, target.encode() + b"\n")
            sent[fifo] = target
        except OSError:
            pass
        finally:
            os.close(fd)
    deadline = clock() + wait_s
    while sent and clock() < deadline and not all(os.path.exists(t) for t in sent.values()):
        sleep(0.05)
    return {f: t for f, t in sent.items() if os.path.exists(t)}


class _PlainUnpickler(pickle.Unpickler):
    """NCCL writes its on-timeout dumps as pickles of plain dicts and lists: refuse anything else."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"flight recorder dump refers to {module}.{name}: refused")


def load_dump(path: str) -> dict[str, Any] | None:
    """A dump file (our JSON or NCCL's pickle), or None when unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        out = json.loads(data) if data[:1] in (b"{", b"[") else _PlainUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, TypeError):
        return None
    return out if isinstance(out, dict) else None


def timeout_dumps(directory: str, since_wall_s: float) -> dict[int, str]:
    """NCCL's own on-timeout dumps in `directory` written after `since_wall_s` (Unix time): {rank: path}."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not name.startswith(NCCL_DUMP_PREFIX) or name.endswith(".tmp"):
            continue
        m = _RANK_SUFFIX.search(name)
        path = os.path.join(directory, name)
        try:
            if m and os.path.getmtime(path) >= since_wall_s:
                out[int(m.group(1))] = path
        except OSError:
            continue
    return out


def _as_int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _pg_progress(dump: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """{pg id: (last enqueued, last completed collective seq)} from pg_status, else from the entries."""
    status = dump.get("pg_status")
    if isinstance(status, dict) and status:
        return {str(pg): (_as_int(s.get("last_enqueued_collective")), _as_int(s.get("last_completed_collective")))
                for pg, s in status.items() if isinstance(s, dict)}
    out: dict[str, tuple[int, int]] = {}
    for e in dump.get("entries") or ():
        if e.get("is_p2p"):
            continue
        pg = str(e.get("pg_id", (e.get("process_group") or ["?"])[0]))
        seq = _as_int(e.get("collective_seq_id"))
        enq, comp = out.get(pg, (-1, -1))
        out[pg] = (max(enq, seq), max(comp, seq) if e.get("state") == "completed" else comp)
    return out


def _entry(dump: Mapping[str, Any], pg: str, seq: int) -> Mapping[str, Any] | None:
    for e in dump.get("entries") or ():
        ids = {str(e.get("pg_id", "")), str((e.get("process_group") or [""])[0])}
        if pg in ids and _as_int(e.get("collective_seq_id")) == seq and not e.get("is_p2p"):
            return e
    return None


def summarise(dumps: Mapping[int, Mapping[str, Any]], expected_ranks: Iterable[int] = ()) -> str:
    """One line: per process group with a collective not completed everywhere, which collective
    (the oldest pending one), the ranks that joined it and those that had not (or sent no dump)."""
    expected = sorted(set(expected_ranks) | set(dumps))
    missing = [r for r in expected if r not in dumps]
    progress = {rank: _pg_progress(d) for rank, d in dumps.items()}
    groups = sorted({pg for p in progress.values() for pg in p}, key=lambda g: (_as_int(g, 1 << 30), g))
    parts = []
    for pg in groups:
        have = {r: p[pg] for r, p in progress.items() if pg in p}
        pending = [comp + 1 for enq, comp in have.values() if enq > comp]
        if not pending:
            continue
        seq = min(pending)
        joined = sorted(r for r, (enq, _) in have.items() if enq >= seq)
        behind = sorted(r for r, (enq, _) in have.items() if enq < seq)
        entry = next((e for r in joined if (e := _entry(dumps[r], pg, seq)) is not None), None)
        what = "collective"
        if entry is not None:
            what = f"{entry.get('profiling_name', '?')} sizes {entry.get('input_sizes', '?')}"
            frame = _user_frame(entry.get("frames") or ())
            if frame:
                what += f" from {frame}"
        parts.append(f"pg {pg} #{seq} {what}: joined by ranks {joined}"
                     + (f", not joined by ranks {behind}" if behind else ""))
    if not parts:
        parts.append("no collective pending" if dumps else "no dumps")
    if missing:
        parts.append(f"no dump from ranks {missing}")
    return "; ".join(parts)


def _user_frame(frames: Iterable[Mapping[str, Any]]) -> str:
    for fr in frames:  # innermost first, as torch records them
        name = str(fr.get("filename", ""))
        if "/torch/" not in name and "site-packages" not in name:
            return f"{os.path.basename(name)}:{fr.get('line')} in {fr.get('name')}"
    return ""
