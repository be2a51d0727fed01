"""Every figure README.md and docs/*.md quote next to a cited results file appears in that file.

The convention (benchmarks/README.md, "Quoting figures"):
- A paragraph or a table *cites* a results file when it names `benchmarks/results/<file>` (in a
  link or a code span). A paragraph's citation also covers the table right after it.
- In a cited paragraph or table, every decimal number (digits, a point, digits: 3.96, 45.7,
  0.100) is a figure, outside code spans and link targets. Integers are not figures (counts,
  trials, ports); versions with two points (2.13.0) are not either.
- Each figure must be a number of one of the cited files, rounded to the decimals shown
  (45.69 in the file may be quoted as 45.7 or 45.69; the sign is not compared).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

CITATION = re.compile(r"benchmarks/results/[A-Za-z0-9_.\-/]*")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.]*\d)")
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def blocks(text: str) -> list[tuple[str, str]]:
    """(kind, text) for each paragraph and table, in order; fenced code is left out."""
    out: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(("code", []))
            continue
        if fenced:
            continue
        if not line.strip():
            out.append(("blank", []))
            continue
        kind = "table" if line.lstrip().startswith("|") else "paragraph"
        if out and out[-1][0] == kind:
            out[-1][1].append(line)
        else:
            out.append((kind, [line]))
    return [(kind, "\n".join(lines)) for kind, lines in out if kind in ("paragraph", "table")]


def cited_units(text: str) -> list[tuple[list[str], str]]:
    """(cited paths, text whose figures they must hold): cited paragraphs and tables, and the
    table right after a cited paragraph."""
    units = []
    parts = blocks(text)
    for i, (kind, body) in enumerate(parts):
        cited = CITATION.findall(body)
        if not cited:
            continue
        units.append((cited, body))
        if kind == "paragraph" and i + 1 < len(parts) and parts[i + 1][0] == "table":
            if not CITATION.findall(parts[i + 1][1]):
                units.append((cited, parts[i + 1][1]))
    return units


def figures(text: str) -> list[str]:
    plain = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))
    return FIGURE.findall(plain)


def file_numbers(path: Path) -> list[float]:
    return [abs(float(n)) for n in NUMBER.findall(path.read_text())]


def appears(figure: str, numbers: list[float]) -> bool:
    decimals = len(figure.split(".")[1])
    value = float(figure)
    return any(math.isclose(n, value, abs_tol=0.5 * 10**-decimals + 1e-9) for n in numbers)


def problems(doc_text: str, repo: Path) -> list[str]:
    """One line per figure that its cited files do not hold, and per citation that is no file."""
    out = []
    for cited, body in cited_units(doc_text):
        paths = [repo / c.rstrip("/.") for c in cited]
        missing = [str(p.relative_to(repo)) for p in paths if not p.is_file()]
        if missing:
            out.append(f"cites {', '.join(missing)}: not a file (cite the results file itself)")
            continue
        numbers = [n for p in paths for n in file_numbers(p)]
        for figure in figures(body):
            if not appears(figure, numbers):
                where = body.splitlines()[0][:70]
                out.append(f"{figure} is not in {', '.join(cited)} (near: {where!r})")
    return out


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_cited_figures_are_in_their_results_files(doc):
    assert problems(doc.read_text(), REPO) == []


def test_the_readme_cites_its_measured_figures():
    units = cited_units((REPO / "README.md").read_text())
    assert sum(len(figures(body)) for _, body in units) >= 5, "README's measured table cites no results file"


def test_the_checker_finds_a_figure_missing_from_its_results_file(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "run.json").write_text('{"median_s": 3.9615281309997954, "cold_s": [5.75, 10.36], "v": 2}')
    doc = (
        "Measured (raw output in [run](benchmarks/results/run.json), `torch 2.13.0`, 3.1):\n\n"
        "| case | s |\n|---|---|\n| worker | 3.96 |\n| node | 4.1 s |\n| cold | 5.7-10.4 |\n\n"
        "Not cited: 9.99 s.\n\n```\n7.77 in a code block\n```\n"
    )
    assert [p.split(" (near")[0] for p in problems(doc, tmp_path)] == [
        "3.1 is not in benchmarks/results/run.json",
        "4.1 is not in benchmarks/results/run.json",
    ]
    assert problems("see `benchmarks/results/` for 1.5 s", tmp_path) == [
        "cites benchmarks/results: not a file (cite the results file itself)"
    ]
