"""The agent raises its soft open-files limit for the rank-0 worker's TCPStore; never lowers it, never the hard one."""

from __future__ import annotations

import resource
import subprocess
import sys

from elastic_rt.agent.limits import CAP, needed_open_files, raise_open_files_limit

NOFILE = resource.RLIMIT_NOFILE
INF = resource.RLIM_INFINITY


class Limits:
    def __init__(self, soft: int, hard: int, fail: bool = False) -> None:
        self.value, self.fail, self.calls = (soft, hard), fail, []

    def get(self, which: int) -> tuple[int, int]:
        assert which == NOFILE
        return self.value

    def set(self, which: int, value: tuple[int, int]) -> None:
        self.calls.append(value)
        if self.fail:
            raise ValueError("not allowed")
        self.value = value


def test_needed_is_one_connection_per_worker_plus_headroom():
    assert needed_open_files(max_nodes=1024, nproc_per_node=8) == 8192 + 1024


def test_raises_soft_to_what_is_needed_within_the_hard_limit():
    lim = Limits(1024, 524288)
    assert raise_open_files_limit(9216, getrlimit=lim.get, setrlimit=lim.set) == (1024, 9216)
    assert lim.value == (9216, 524288)


def test_hard_limit_caps_it_and_the_shortfall_is_logged(caplog):
    lim = Limits(1024, 4096)
    assert raise_open_files_limit(9216, getrlimit=lim.get, setrlimit=lim.set) == (1024, 4096)
    assert lim.value == (4096, 4096)
    assert "ulimit -n 9216" in caplog.text


def test_never_lowers_and_leaves_a_sufficient_limit_alone():
    lim = Limits(65536, 65536)
    assert raise_open_files_limit(9216, getrlimit=lim.get, setrlimit=lim.set) == (65536, 65536)
    lim2 = Limits(INF, INF)
    assert raise_open_files_limit(9216, getrlimit=lim2.get, setrlimit=lim2.set) == (INF, INF)
    assert lim.calls == lim2.calls == []


def test_unlimited_hard_is_capped():
    lim = Limits(1024, INF)
    assert raise_open_files_limit(CAP * 4, getrlimit=lim.get, setrlimit=lim.set) == (1024, CAP)
    assert lim.value == (CAP, INF)


def test_a_refusal_keeps_the_old_limit(caplog):
    lim = Limits(1024, 8192, fail=True)
    assert raise_open_files_limit(4096, getrlimit=lim.get, setrlimit=lim.set) == (1024, 1024)
    assert lim.value == (1024, 8192) and "could not raise" in caplog.text


def test_real_process_limit_is_raised_and_inherited_by_its_children():
    """In a child whose soft limit starts at 256: the real setrlimit, then a grandchild sees it."""
    code = (
        "import resource, subprocess, sys\n"
        "from elastic_rt.agent.limits import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "print(raise_open_files_limit(min(hard, 2048)))\n"
        "print(subprocess.run([sys.executable, '-c', 'import resource; "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])'], capture_output=True, text=True).stdout.strip())\n"
    )
    _, hard = resource.getrlimit(NOFILE)
    want = min(hard, 2048) if hard != INF else 2048

    def low():
        resource.setrlimit(NOFILE, (256, hard))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=low)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n")[:2]
    assert first == f"(256, {want})" and second == str(want), out.stdout
