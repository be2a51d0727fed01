"""Time from a fault to each shipped alert `firing` in a real Prometheus, with the shipped rules and scrape
config unchanged (production `for:` and intervals), and a picture of the dashboard during the node loss.

The run is tests/support/node_loss.py's: two of three nodes die, a replacement starts 130 s after the second
loss, a worker crashes four times. Each alert's first `pending` and `firing` are polled from /api/v1/alerts
every second; the results file holds the time from its fault, `elastic-rt status` at each step, and the PNG
(benchmarks/dashboard_png.py) is drawn from that run's Prometheus.

    python benchmarks/alert_latency.py [--png docs/img/dashboard-node-loss.png]   # ~10 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from dashboard_png import render  # noqa: E402 - benchmarks/ is sys.path[0]
from provenance import provenance  # noqa: E402
from results_file import write_results  # noqa: E402

from tests.support.node_loss import NodeLossSettings, run_node_loss  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = NodeLossSettings()
    p.add_argument("--interval-s", type=int, default=d.interval_s, help="scrape and evaluation interval (shipped: 15)")
    p.add_argument("--baseline-s", type=float, default=d.baseline_s, help="steady training before the faults")
    p.add_argument("--second-loss-after-s", type=float, default=d.second_loss_after_s)
    p.add_argument("--replace-after-s", type=float, default=d.replace_after_s, help="seconds a stays below MIN")
    p.add_argument("--crashes", type=int, default=d.crashes)
    p.add_argument("--max-wait-s", type=float, default=d.max_wait_s, help="give up on alerts not firing by then")
    p.add_argument("--png", default=os.path.join(REPO, "docs", "img", "dashboard-node-loss.png"))
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    git = provenance(args.allow_dirty)
    settings = NodeLossSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(NodeLossSettings)})
    load_start = os.getloadavg()

    def draw(prom, run_id, started, ended, events):
        return render(prom.url, run_id=run_id, start=started, end=ended, out=args.png, marks=events,
                      title=f"The shipped elastic-rt dashboard during a node-loss run (minutes since the agents "
                            f"started; scrape every {settings.interval_s} s)")

    with tempfile.TemporaryDirectory(prefix="elastic-rt-alerts-") as tmp:
        result = run_node_loss(settings, Path(tmp), draw, log=lambda line: print(line, file=sys.stderr, flush=True))
    result["png"] = os.path.relpath(args.png, REPO)
    stamp = datetime.date.today().isoformat()
    payload = {"benchmark": "alert_latency", "date": stamp, "provenance": git,
               "host": {"cpus": os.cpu_count(), "loadavg_at_start": list(load_start),
                        "loadavg_at_end": list(os.getloadavg())},
               "settings": dataclasses.asdict(settings), **result}
    lines = [f"alert latency {stamp}: code {git['commit']}{' (dirty)' if git['dirty'] else ''}, shipped rules and "
             f"scrape config, scrape and evaluation every {settings.interval_s} s; load average "
             f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)", "",
             f"{'alert':<24} {'fault':<86} {'to active':>10} {'to firing':>10}"]
    for key, a in result["alerts"].items():
        fmt = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
        lines.append(f"{key:<24} {a['fault']:<86} {fmt(a['fault_to_active_s']):>10} "
                     f"{fmt(a['fault_to_firing_s']):>10}")
    lines += ["", f"recovery after the second node loss: {result['recovery_after_second_loss_s']} s "
              f"(replacement started after {result['replacement_started_after_s']} s)",
              f"other alerts that fired: {', '.join(result['other_alerts_firing']) or 'none'}",
              f"panels without data: {', '.join(result['panels_without_data']) or 'none'}; picture: {result['png']}",
              "", *(f"--- elastic-rt status, {k}:\n{v}" for k, v in result["status"].items())]
    write_results(args.out, "alert-latency", stamp, payload, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
