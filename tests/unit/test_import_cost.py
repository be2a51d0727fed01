"""What each entry point imports: the commands an operator runs on a login node (`status`, `gc`, `doctor`,
`checkpoint`, `chaos`) never load torch, and the agent never loads torch.distributed.checkpoint (several
seconds of imports on a busy node; only the workers' CheckpointManager needs it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.chaos.harness import ROOT


def _loaded(statement: str, modules: tuple[str, ...]) -> list[str]:
    code = f"{statement}\nimport sys\nprint(' '.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("statement", [
    "from elastic_rt.cli import build_parser; build_parser()",
    "import elastic_rt.status.command, elastic_rt.rendezvous.gc, elastic_rt.checkpoint.cli, elastic_rt.doctor.command",
])
def test_the_operator_commands_do_not_import_torch(statement):
    assert _loaded(statement, ("torch",)) == []


def test_the_agent_does_not_import_torch_distributed_checkpoint():
    assert _loaded("import elastic_rt.launch", ("torch", "torch.distributed.checkpoint")) == ["torch"]


def test_the_checkpoint_package_still_offers_its_names():
    assert _loaded("from elastic_rt.checkpoint import CheckpointManager, CheckpointStore, Manifest",
                   ("torch.distributed.checkpoint",)) == ["torch.distributed.checkpoint"]


def test_a_bad_launch_flag_is_refused_before_torch_is_imported():
    code = ("import sys\nfrom elastic_rt.cli import main\nrc = main(['launch', '--nnodes', '3:2', 'train.py'])\n"
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)
    assert "MIN (3) is larger than MAX (2)" in out.stderr
