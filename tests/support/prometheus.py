"""A real Prometheus server (Debian's `prometheus`) on a free loopback port with a config and rule files of the
caller's; its HTTP API (instant and range queries, alerts, rules). Used by the Prometheus tests and by
benchmarks/alert_latency.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from etcd_testbed.server import free_port

T = TypeVar("T")
INSTALL_HINT = "apt-get install --no-install-recommends prometheus"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def wait_until(what: str, check: Callable[[], T], timeout_s: float, *, poll_s: float = 0.5,
               detail: Callable[[], str] = lambda: "") -> T:
    """check() until it returns something true (which is returned), polling; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s. {detail()}")
        time.sleep(poll_s)


class PrometheusServer:
    """`prometheus` with `config` (a prometheus.yml as a dict, rule_files relative to `workdir`) and the rule
    files given as {name: groups document}, its TSDB under workdir. Stopped (and its output kept in
    `log`) by stop() or the context manager."""

    def __init__(self, *, config: dict, rule_files: dict[str, dict], workdir: Path, binary: str | None = None) -> None:
        self.workdir = workdir
        self.binary = binary or prometheus_binary() or "prometheus"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        for name, doc in rule_files.items():
            (workdir / name).write_text(yaml.safe_dump(doc, sort_keys=False))
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                 "--storage.tsdb.retention.time=1d"],
                stdout=log, stderr=subprocess.STDOUT, cwd=str(self.workdir), start_new_session=True)
        wait_until("prometheus ready", self._ready, timeout_s, poll_s=0.2, detail=lambda: self.log)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- HTTP API --------------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer, else RuntimeError with Prometheus's error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}")["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def rule_states(self) -> dict[tuple[str, str], dict]:
        """(group, rule name) -> the rule as /api/v1/rules reports it (state, alerts, health, lastError)."""
        return {(g["name"], r["name"]): r for g in self.api("rules")["groups"] for r in g["rules"]}
