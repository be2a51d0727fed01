"""torch's private seams (elastic_rt/torch_seams.py): each one still holds in the installed torch; a torch release that
renames, removes or re-signs one fails here, naming it and the module of elastic-rt that relies on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from elastic_rt import torch_seams
from elastic_rt.torch_seams import SEAMS, Seam, seam_problem

PACKAGE = Path(torch_seams.__file__).parent


@pytest.mark.parametrize("seam", SEAMS, ids=lambda s: s.label)
def test_each_seam_holds_in_this_torch(seam):
    if torch_seams._missing_feature(seam):
        pytest.skip(f"{seam.label}: this torch build has no {seam.needs}")
    assert seam_problem(seam) is None, seam_problem(seam)


def test_a_changed_seam_is_named_with_its_user():
    gone = Seam(owner="torch.distributed.elastic.multiprocessing.api:SubprocessContext", name="_poll_v2",
                kind="method", used_by="agent/warm_start.py")
    assert seam_problem(gone) == ("torch's SubprocessContext._poll_v2 (used by elastic_rt/agent/warm_start.py): gone")
    resigned = Seam(owner="torch.distributed.elastic.multiprocessing.api:SubprocessContext", name="_poll",
                    kind="method", params=("self", "timeout"), used_by="agent/warm_start.py")
    assert "parameters are now ('self',), elastic-rt passes ('self', 'timeout')" in seam_problem(resigned)
    unset = Seam(owner="torch.distributed.elastic.multiprocessing.api:SubprocessContext", name="_no_such_state",
                 kind="attribute", used_by="diagnostics/exit_aborts.py")
    assert seam_problem(unset).endswith("no longer set by torch")
    moved = Seam(owner="torch.distributed.no_such_module", name="x", kind="name", used_by="worker/numa.py")
    assert "torch.distributed.no_such_module is gone" in seam_problem(moved)


def _private_torch_names(source: str) -> set[str]:
    """Private names imported from torch, or reached as torch.a._b attribute chains, in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
            if any(part.startswith("_") for part in node.module.split(".")):
                found.add(node.module)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            text = ast.unparse(node)
            if text.startswith("torch.") or text.startswith("dist."):
                found.add(text)
    return found


def test_only_the_seams_module_and_the_listed_users_reach_torch_privates():
    """A new private import of torch outside torch_seams.py must be listed in SEAMS (or moved there)."""
    users = {seam.used_by.split(" ")[0].rstrip(",") for seam in SEAMS} | {
        part.strip().split(" ")[0] for seam in SEAMS for part in seam.used_by.split(",")}
    strays = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "torch_seams.py":
            continue
        names = _private_torch_names(path.read_text())
        if names and rel not in users:
            strays[rel] = sorted(names)
    assert strays == {}, f"torch privates outside elastic_rt/torch_seams.py and not in its SEAMS: {strays}"
