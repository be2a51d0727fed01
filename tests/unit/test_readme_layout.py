"""README's layout block matches the tree: every area of the package is named there, and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _layout_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def _areas() -> set[str]:
    """Sub-packages as `name/`, top-level modules as `name.py` (the package's __init__ aside)."""
    package = REPO / "elastic_rt"
    subpackages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    return subpackages | modules


def test_every_area_of_the_package_is_in_the_layout_block():
    block = _layout_block()
    missing = sorted(a for a in _areas() if not re.search(rf"(?<![\w.]){re.escape(a)}", block))
    assert missing == [], f"README's layout block does not name: {missing}"


def test_every_path_the_layout_block_names_exists():
    block = _layout_block()
    named = set(re.findall(r"elastic_rt/[\w/]+(?:\.py)?", block))
    named |= {m for line in block.splitlines() if line.startswith(("launch/", "k8s/", "benchmarks/", "tests/",
                                                                   "etcd_testbed/"))
              for m in [line.split()[0]]}
    gone = sorted(n for n in named if not (REPO / n).exists())
    assert gone == [], f"README's layout block names paths that do not exist: {gone}"
