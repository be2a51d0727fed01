"""The shipped Grafana dashboard's panels, variables and queries as Grafana sends them; read by
benchmarks/dashboard_png.py and the Prometheus end-to-end tests."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "k8s" / "monitoring" / "dashboards" / "elastic-rt.json"


@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    type: str
    exprs: tuple[str, ...]
    legends: tuple[str, ...]


def dashboard_panels() -> list[Panel]:
    dash = json.loads(DASHBOARD.read_text())
    return [Panel(p["id"], p["title"], p["type"], tuple(t["expr"] for t in p["targets"]),
                  tuple(t.get("legendFormat", "") for t in p["targets"]))
            for p in dash["panels"] if p["type"] != "row"]


def dashboard_variables() -> dict[str, tuple[str, str]]:
    """name -> (series selector, label) of each label_values(...) variable of the dashboard."""
    out = {}
    for v in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v.get("definition", ""))
        if m:
            out[v["name"]] = (m.group(1), m.group(2))
    return out


def grafana_expand(expr: str, *, run_id: str, range_s: float) -> str:
    """The query Grafana sends: $namespace All (.*), $run_id this run (regex-escaped, as Grafana does for
    a =~ matcher), $__range the dashboard's time range."""
    expr = expr.replace("$namespace", ".*").replace("$run_id", re.escape(run_id).replace("\\", "\\\\"))
    return expr.replace("$__range", f"{max(1, int(range_s))}s")
