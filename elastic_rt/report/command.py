"""`elastic-rt report PATH...`: print a run's timeline, restarts with causes and durations, goodput by
category and stragglers from the agents' goodput journals; --plot FILE.png draws it (matplotlib)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from elastic_rt.goodput.ledger import CATEGORIES
from elastic_rt.report.timeline import Timeline, load

CATEGORY_TEXT = {
    "productive": "productive training", "startup": "startup (to the first step)",
    "restart": "rendezvous and restart", "checkpoint": "checkpoint (blocked)", "restore": "restore (to the first step)",
    "lost": "progress lost (re-done)", "other": "other",
}


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `report` on the top-level parser's subparsers."""
    p = subparsers.add_parser(
        "report", help="timeline, restarts, goodput and stragglers of a run, from the agents' log dirs",
        description="Read the goodput-<node>.jsonl journals under each PATH (an agent's --log-dir, or a "
                    "directory holding several) and print the run's timeline.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="agent log dir, journal file, or a directory of them")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the timeline and the world size over time (needs matplotlib: "
                        "pip install 'elastic-rt[plot]')")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    timeline = load(args.paths)
    print(render(timeline), file=out)
    if args.plot:
        from elastic_rt.report.plot import plot

        plot(timeline, args.plot)
        print(f"\nplot written to {args.plot}", file=out)
    return 0


def _fmt_reason(reason: str) -> str:
    """'worker_failure (rank 1 cause=...)' -> 'worker failure (rank 1 cause=...)': the causes keep their spelling."""
    head, sep, tail = reason.partition(" (")
    return head.replace("_", " ") + sep + tail


def render(t: Timeline) -> str:
    t0 = t.start
    rel = lambda x: f"{x - t0:+8.1f}"  # noqa: E731
    lines = [
        f"run {', '.join(t.run_ids)}: {len(t.nodes)} node(s) ({', '.join(t.nodes)}), "
        f"{t.end - t0:.1f} s from the first agent's start to the last line "
        f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))})",
        "", "Timeline (seconds since the start):",
    ]
    for s, e in t.events("start", "rendezvous", "failure", "restart", "first_step", "lost", "straggler", "finished",
                         "exit"):
        kind = e["event"]
        if kind == "start":
            text = f"agent started (pid {s.pid})"
        elif kind == "rendezvous":
            text = (f"round {e.get('round')}: {e.get('nodes')} node(s), {e.get('world_size')} worker(s) "
                    f"(rendezvous {float(e.get('duration_s', 0)):.1f} s)")
        elif kind == "restart":
            committed = e.get("committed_step")
            text = f"restart: {_fmt_reason(e.get('reason', '?'))}" + (
                f" (last commit: step {committed})" if committed is not None else "")
        elif kind == "failure":
            text = f"worker failed: rank {e.get('rank', '?')} {e.get('cause', '')}"
        elif kind == "first_step":
            text = f"training (first step seen: {e.get('step')})"
        elif kind == "lost":
            text = f"progress lost: {e.get('steps')} step(s), {float(e.get('seconds', 0)):.1f} s re-done"
        elif kind == "straggler":
            what = "compute time" if e.get("signal") == "compute" else "step time"
            text = (f"STRAGGLER local rank {e.get('local_rank')}: {float(e.get('ratio', 0)):.2f}x the job median {what} "
                    f"({float(e.get('value_s', e.get('step_time_s', 0))):.4g} s vs {float(e.get('median_s', 0)):.4g} s), "
                    f"action {e.get('action', 'report')}")
        elif kind == "finished":
            text = f"workers finished: {e.get('state')}"
        else:
            text = f"agent exit (goodput {100 * float(e.get('ratio', 0)):.1f} %)"
        lines.append(f"  {rel(e['time'])}  {s.node:<12} {text}")
    checkpoints = t.events("checkpoint")
    if checkpoints:
        steps = [e.get("step") for _, e in checkpoints]
        lines.append(f"  ({len(checkpoints)} checkpoint commit line(s); last step {steps[-1]})")

    incidents = t.incidents()
    lines += ["", f"Restarts: {len(incidents)}"]
    if incidents:
        lines.append(f"  {'#':>2}  {'at':>8}  {'training again':>14}  {'recovery':>9}  {'lost steps':>10}  "
                     f"{'lost node-s':>11}  cause(s)")
        for i, inc in enumerate(incidents, 1):
            back = rel(inc.back) if inc.back is not None else "never"
            rec = f"{inc.recovery_s:.1f} s" if inc.recovery_s is not None else "-"
            causes = "; ".join(f"{node}: {_fmt_reason(reason)}" for node, reason in inc.causes)
            lines.append(f"  {i:>2}  {rel(inc.start):>8}  {back:>14}  {rec:>9}  {inc.lost_steps:>10}  "
                         f"{inc.lost_s:>11.1f}  {causes}")

    totals, uncommitted, unaccounted, incomplete = t.totals()
    wall = sum(totals.values()) + uncommitted + unaccounted
    lines += ["", f"Goodput (node-seconds, {len(t.sessions)} agent(s)):"]
    for c in CATEGORIES:
        share = 100 * totals[c] / wall if wall > 0 else 0.0
        lines.append(f"  {CATEGORY_TEXT[c]:<30} {totals[c]:9.1f} s  {share:5.1f} %")
    if uncommitted > 0:
        lines.append(f"  {'uncommitted (agent ended early)':<30} {uncommitted:9.1f} s  {100 * uncommitted / wall:5.1f} %")
    if unaccounted > 0:
        lines.append(f"  {'not accounted (no exit line)':<30} {unaccounted:9.1f} s  {100 * unaccounted / wall:5.1f} %")
    lines.append(f"  {'total':<30} {wall:9.1f} s")
    if incomplete:
        lines.append(f"  ({incomplete} agent(s) wrote no exit line (killed?): their last periodic totals are used)")

    stragglers = t.events("straggler")
    lines += ["", "Stragglers: " + ("none" if not stragglers else str(len(stragglers)))]
    for s, e in stragglers:
        lines.append(f"  {rel(e['time'])}  node {s.node} local rank {e.get('local_rank')}: "
                     f"{float(e.get('ratio', 0)):.2f}x the median for {e.get('windows')} window(s), "
                     f"action {e.get('action', 'report')}")
    lines += ["", "Agents:"]
    for s in t.sessions:
        lines.append(f"  {s.node:<12} pid {s.pid:<8} {rel(s.start)} .. {rel(s.end)}  {s.final_state}")
    return "\n".join(lines)
