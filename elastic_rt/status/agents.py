"""Each agent's own endpoints over HTTP: /metrics parsed into samples, /livez and /readyz ?verbose into checks."""

from __future__ import annotations

import http.client
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# Answers larger than this are cut: an agent's /metrics is a few tens of kB (RDMA counters included).
MAX_BODY_BYTES = 8 << 20
DEFAULT_PARALLEL = 32



@dataclass(frozen=True)
class Check:
    """One /livez or /readyz check as ?verbose reports it."""

    name: str
    ok: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class AgentReading:
    """What one agent answered; `error` says why it did not (then the rest is empty)."""

    address: str
    error: str | None = None
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    liveness: tuple[Check, ...] = ()
    readiness: tuple[Check, ...] = ()

    @property
    def answered(self) -> bool:
        return self.error is None

    def values(self, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every sample `name` whose labels include `match`."""
        return [(labels, v) for labels, v in self.samples.get(name, ())
                if all(labels.get(k) == want for k, want in match.items())]

    def value(self, name: str, **match: str) -> float | None:
        """The greatest value of the matching samples (None: no such sample)."""
        found = [v for _, v in self.values(name, **match) if v == v]  # NaN is no value
        return max(found) if found else None


Fetch = Callable[[str, float], str]


def fetch(url: str, timeout_s: float) -> str:
    """GET url; the body of a 200 or a 503 (health endpoints answer 503 with their checks)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read(MAX_BODY_BYTES).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return exc.read(MAX_BODY_BYTES).decode("utf-8", errors="replace")
        raise


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def parse_checks(text: str) -> tuple[Check, ...]:
    """`[+]name ok: reason` / `[-]name failed: reason` lines of a ?verbose answer."""
    checks = []
    for line in text.splitlines():
        if line[:3] in ("[+]", "[-]"):
            head, _, reason = line[3:].partition(": ")
            checks.append(Check(head.split(" ", 1)[0], line[1] == "+", reason.strip()))
    return tuple(checks)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "no answer in time"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return " ".join(str(reason or exc).split()) or type(exc).__name__


def read_agent(address: str, *, timeout_s: float, get: Fetch = fetch) -> AgentReading:
    """/metrics, /livez?verbose and /readyz?verbose of the agent at host:port, each within timeout_s."""
    base = f"http://{address}"
    try:
        samples = parse_metrics(get(base + "/metrics", timeout_s))
        liveness = parse_checks(get(base + "/livez?verbose", timeout_s))
        readiness = parse_checks(get(base + "/readyz?verbose", timeout_s))
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError is an OSError
        return AgentReading(address=address, error=_describe(exc))
    return AgentReading(address=address, samples=samples, liveness=liveness, readiness=readiness)


def read_agents(addresses: Mapping[str, str], *, timeout_s: float, parallel: int = DEFAULT_PARALLEL,
                get: Fetch = fetch) -> dict[str, AgentReading]:
    """node -> its agent's reading, `parallel` agents at a time (an agent that does not answer costs
    at most 3 x timeout_s of one thread)."""
    if not addresses:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(addresses))),
                            thread_name_prefix="elastic-rt-status") as pool:
        futures = {node: pool.submit(read_agent, addr, timeout_s=timeout_s, get=get)
                   for node, addr in addresses.items()}
        return {node: f.result() for node, f in futures.items()}

