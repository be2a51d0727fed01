"""Draw the main panels of the shipped Grafana dashboard (k8s/monitoring/dashboards/elastic-rt.json) as one PNG,
from a Prometheus's query_range API, with matplotlib: what an operator sees, without Grafana.

    python benchmarks/dashboard_png.py --prometheus http://127.0.0.1:9090 --run-id job42 \\
        --start 1796140000 --end 1796140600 --out docs/img/dashboard-node-loss.png

benchmarks/alert_latency.py calls render() at the end of its node-loss run (that is how docs/metrics.md's
picture is made). Each panel's queries are the dashboard's own, with Grafana's variables filled in as
Grafana would ($namespace All, $run_id the run, $__range the time range).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.parse
import urllib.request
from datetime import datetime

from dashboard_queries import Panel, dashboard_panels, grafana_expand  # benchmarks/dashboard_queries.py

# The panels drawn, by title, in reading order (3 columns).
MAIN_PANELS = (
    "Nodes in the round", "World size (workers)", "Restarts per hour by cause",
    "Steps per second (job and slowest worker per node)", "Seconds since last step (worst worker)",
    "Recovery time p50 / p95",
    "Goodput ratio: per node (live), job (last hour)", "Median step time per worker", "Stragglers",
    "Checkpoint age", "Worker state", "Rendezvous round",
)
UNITS = {"Checkpoint age": "s", "Seconds since last step (worst worker)": "s", "Recovery time p50 / p95": "s",
         "Median step time per worker": "s"}


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                     "step": f"{step_s:g}"})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=60) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    return text or ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"


def render(prometheus: str, *, run_id: str, start: float, end: float, out: str,
           marks: list[tuple[float, str]] = (), panels: list[Panel] | None = None, title: str = "") -> list[str]:
    """Write the PNG; returns the titles of the panels that had nothing to draw (drawn as empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_title = {p.title: p for p in (panels or dashboard_panels())}
    chosen = [by_title[t] for t in MAIN_PANELS if t in by_title]
    step_s = max(1.0, (end - start) / 300)
    cols = 3
    rows = math.ceil(len(chosen) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 2.6 * rows + 0.6), sharex=True, squeeze=False)
    empty = []
    for ax, panel in zip(axes.flat, chosen):
        drawn = 0
        for expr, fmt in zip(panel.exprs, panel.legends):
            query = grafana_expand(expr, run_id=run_id, range_s=end - start)
            for series in query_range(prometheus, query, start, end, step_s):
                xs = [(float(t) - start) / 60 for t, v in series["values"] if math.isfinite(float(v))]
                ys = [float(v) for _, v in series["values"] if math.isfinite(float(v))]
                if xs:
                    ax.plot(xs, ys, label=legend(fmt, series["metric"]), linewidth=1.4)
                    drawn += 1
        if not drawn:
            empty.append(panel.title)
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        for at, _ in marks:
            ax.axvline((at - start) / 60, color="black", linestyle=":", linewidth=0.9)
        unit = UNITS.get(panel.title)
        ax.set_title(panel.title + (f" ({unit})" if unit else ""), fontsize=9.5, loc="left", pad=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best", ncol=2 if drawn > 4 else 1, framealpha=0.7)
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=8)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    for ax in axes[0]:  # the marks, numbered above the first row (their meaning in the title)
        for i, (at, _) in enumerate(marks, 1):
            ax.annotate(str(i), ((at - start) / 60, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 1),
                        textcoords="offset points", fontsize=7, ha="center", va="bottom", color="black")
    heading = title or f"elastic-rt dashboard, run {run_id}, from {datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S}"
    if marks:
        heading += "\n" + "; ".join(f"{i}: {label}" for i, (_, label) in enumerate(marks, 1))
    fig.suptitle(heading, fontsize=10.5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return empty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--run-id", required=True)
    p.add_argument("--start", type=float, required=True, help="Unix time")
    p.add_argument("--end", type=float, required=True, help="Unix time")
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args(argv)
    empty = render(args.prometheus.rstrip("/"), run_id=args.run_id, start=args.start, end=args.end, out=args.out)
    print(f"written: {args.out}" + (f"; no data for: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
