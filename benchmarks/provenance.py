"""Which code a benchmark ran: the git commit, and a refusal to run on uncommitted changes.

    from provenance import provenance          # benchmarks/ is on sys.path when run as a script
    results["provenance"] = provenance(args.allow_dirty)

provenance(allow_dirty) returns {"commit", "dirty", "allow_dirty", "changes"} for the results
file; on a working tree with uncommitted changes it raises SystemExit with one line unless
allow_dirty is true (the run is then recorded as dirty, with the changed paths). Files under
benchmarks/results/ do not count: a run writes its own output there.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = "benchmarks/results/"


def _git(repo: str, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip() or f"git {' '.join(args)} failed")
    return proc.stdout


def provenance(allow_dirty: bool, *, repo: str = REPO) -> dict:
    """The commit the checkout `repo` is at and whether its tree differs from it (see module doc)."""
    try:
        commit = _git(repo, "rev-parse", "HEAD").strip()
        status = _git(repo, "status", "--porcelain", "--untracked-files=all")
    except (OSError, subprocess.SubprocessError) as exc:
        if not allow_dirty:
            raise SystemExit(f"benchmark: cannot read the git commit of {repo} ({exc}); "
                             "run from a git checkout, or pass --allow-dirty (recorded in the results)") from exc
        return {"commit": "unknown", "dirty": True, "allow_dirty": True, "changes": []}
    changes = [line[3:] for line in status.splitlines() if not line[3:].startswith(RESULTS_DIR)]
    if changes and not allow_dirty:
        shown = ", ".join(changes[:5]) + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise SystemExit(f"benchmark: the working tree has uncommitted changes ({shown}); commit them, "
                         "or pass --allow-dirty (recorded in the results)")
    return {"commit": commit, "dirty": bool(changes), "allow_dirty": allow_dirty, "changes": changes}


def machine_speed() -> dict:
    """What the machine is, beside its core count: the CPU model /proc/cpuinfo names and the CPU seconds one
    thread takes for a fixed pure-Python loop (2,000,000 additions, the best of 3), taken before the run. Sessions
    land on different hosts; a slower core makes every client CPU figure larger, so compare runs only where this is
    close."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    best = float("inf")
    for _ in range(3):
        t, s = time.process_time(), 0
        for i in range(2_000_000):
            s += i
        best = min(best, time.process_time() - t)
    return {"cpu_model": model, "python_loop_2m_s": round(best, 4), "page_fault_us": page_fault_us()}


def page_fault_us(pages: int = 8192, tries: int = 3) -> float:
    """Microseconds per 4 KiB page that a process touches for the first time (a fresh anonymous mapping written
    through in C: the kernel's fault, and its zeroing of the page), the best of `tries`. Small on a host that keeps
    a process's freed memory (not measured by this project on one); 2-5 us on the AMD EPYC VM of the results of
    2026-12-07, whose memory the hypervisor takes back when the guest frees it (free page reporting, proactive
    reclaim), where every process that frees and allocates memory again (etcd's Go heap, a Python process's arenas
    and thread stacks) pays it over and over."""
    size = pages * mmap.PAGESIZE
    best = float("inf")
    for _ in range(tries):
        with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE) as m:  # private anonymous memory, as a heap's
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                m.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages, each faulted on its own, even where THP is "always"
            buf = ctypes.c_char.from_buffer(m)
            t = time.perf_counter()
            ctypes.memset(ctypes.addressof(buf), 1, size)
            best = min(best, time.perf_counter() - t)
            del buf  # the mapping closes only once nothing exports its buffer
    return round(1e6 * best / pages, 3)


def disk_fsync_ms(directory: str, writes: int = 200, size: int = 2300) -> dict:
    """How fast the disk under `directory` makes a small write durable, as etcd's WAL does for every raft batch:
    `writes` sequential appends of `size` bytes to a new file there, each followed by fdatasync (the recipe of the
    fio test etcd's operators run: --rw=write --ioengine=sync --fdatasync=1 --bs=2300). Returns the median and
    the 99th percentile in ms, and the directory. etcd's maintainers ask for a WAL fsync p99 under 10 ms (OpenShift's
    check: 20 ms); a disk slower than that lets etcd's leader fall behind, and leases lapse (docs/scale.md). On
    tmpfs both are about a microsecond."""
    path = os.path.join(directory, f".fsync-probe-{os.getpid()}")
    block, times = b"\0" * size, []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for _ in range(writes):
            os.write(fd, block)
            t = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    times.sort()
    return {"p50_ms": round(1e3 * times[len(times) // 2], 3), "p99_ms": round(1e3 * times[(99 * len(times)) // 100], 3),
            "dir": directory}
