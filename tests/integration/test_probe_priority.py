"""The collective probe child lowers its priority before it imports torch, most of its CPU time.

The probe starts with the workers of every round: at full priority its torch import would compete with the
workers' start-up and delay the round's first step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_rt.collectors.probe import PROBE_NICENESS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs the probe child as spawn_probe does (python -m ...), and reports its niceness at the
# moment `import torch` starts. Rank 1 meets nobody on port 1: the probe fails fast, as intended.
CHILD = """
import os, runpy, sys

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("niceness at import torch:", os.nice(0), flush=True)
        return None

sys.meta_path.insert(0, Watch())
sys.argv = ["probe", "--master-addr", "127.0.0.1", "--master-port", "1", "--rank", "1",
            "--world-size", "2", "--timeout", "1"]
runpy.run_module("elastic_rt.collectors.probe", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(600)
def test_probe_child_is_niced_before_importing_torch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("niceness at import torch:")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert int(lines[0].rsplit(":", 1)[1]) == min(19, os.nice(0) + PROBE_NICENESS)
    assert proc.returncode == 1 and "collective probe failed" in proc.stderr  # one line, no peer


def test_importing_the_probe_module_does_not_import_torch():
    code = "import sys, elastic_rt.collectors.probe; print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
