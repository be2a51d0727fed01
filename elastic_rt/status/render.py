"""JobStatus as text for a terminal (one screen) and as JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
import time
from enum import Enum

from elastic_rt.decisions import Signal
from elastic_rt.status.model import JobStatus, LastFailure, NodeStatus

JSON_SCHEMA_VERSION = 1
COLUMNS = ("NODE", "STATE", "RANK", "METRICS", "STEP", "STEPS/S", "STEP TIME", "GOODPUT", "RESTARTS", "NOTE")
NOTE_MAX_CHARS = 100


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason.replace('_', ' ')} {n}" for reason, n in counts.items())


def _failure(f: LastFailure) -> str:
    what = f.reason.replace("_", " ")
    if f.failed_node:
        what += f" on {f.failed_node}" + (f" (cause: {f.cause})" if f.cause else "")
    text = f"last failure {_age(f.age_s)} ago: {what}; restarted by {', '.join(f.seen_by)}"
    return text + (f"; lost now: {', '.join(f.lost)}" if f.lost else "")


def _note(n: NodeStatus) -> str:
    if n.error:
        note = n.error
    elif n.failing:
        note = "failing " + "; ".join(n.failing)
    elif n.stragglers:
        note = "straggler: local rank " + ", ".join(str(r) for r in n.stragglers)
    else:
        note = n.activity or ""
    return note if len(note) <= NOTE_MAX_CHARS else note[: NOTE_MAX_CHARS - 3] + "..."


def _row(n: NodeStatus) -> tuple[str, ...]:
    dash = "-"
    return (
        n.node, n.state.value, dash if n.rank is None else str(n.rank), n.address or dash,
        dash if n.step is None else str(n.step),
        dash if n.steps_per_s is None else f"{n.steps_per_s:.2f}",
        dash if n.step_time_s is None else f"{n.step_time_s:.3f} s",
        dash if n.goodput is None else f"{100 * n.goodput:.0f}%",
        dash if n.restarts is None else str(n.restarts), _note(n),
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    right = {"RANK", "STEP", "STEPS/S", "STEP TIME", "GOODPUT", "RESTARTS"}
    out = []
    for r in rows:
        cells = [c.rjust(w) if COLUMNS[i] in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def render_text(s: JobStatus) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.generated_at))
    if s.finished:
        head = f"run {s.run_id}: finished (closed)"
    elif s.round is None:
        head = f"run {s.run_id}: no round yet"
    else:
        limits = f" of --nnodes {s.nnodes[0]}:{s.nnodes[1]}" if s.nnodes else ""
        if s.formed:
            head = f"run {s.run_id}: round {s.round} formed, {len(s.members)} node(s){limits}" + (
                f", world size {s.world_size}" if s.world_size is not None else "")
        else:
            head = f"run {s.run_id}: round {s.round} forming, {s.alive} node(s) alive{limits}"
    lines = [f"{head}; {s.answering} of {len(s.nodes)} agent(s) answer; {when}"]
    facts = []
    if s.goodput is not None:
        facts.append(f"goodput {100 * s.goodput:.1f}% so far")
    if s.checkpoint_step is not None:
        facts.append(f"checkpoint step {s.checkpoint_step}" + (
            f", committed {_age(s.checkpoint_age_s)} ago" if s.checkpoint_age_s is not None else ""))
    else:
        facts.append("no checkpoint reported")
    if s.restarts:
        facts.append(f"restarts {sum(s.restarts.values())} ({_reasons(s.restarts)})")
    lines.append("; ".join(facts))
    if s.last_failure is not None:
        lines.append(_failure(s.last_failure))
    if s.stragglers:
        lines.append("stragglers: " + ", ".join(
            f"{x.node} local rank {x.local_rank}" + (
                f" at {x.ratio:.2f}x the job median {'compute time' if x.signal is Signal.COMPUTE else 'step time'}"
                if x.ratio else "")
            for x in s.stragglers))
    lines += [f"problem: {p}" for p in s.problems]
    lines.append("")
    lines += _table([COLUMNS, *(_row(n) for n in s.nodes)])
    return "\n".join(lines)


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def render_json(s: JobStatus) -> str:
    """One line of JSON: {"version": 1, ...every JobStatus field}; node states as their names."""
    return json.dumps({"version": JSON_SCHEMA_VERSION, **dataclasses.asdict(s)}, default=_plain, sort_keys=False)
