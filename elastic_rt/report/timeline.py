"""The goodput journals of one or more agents -> one run's timeline: phases per agent, restarts grouped
into incidents across nodes, world size over time, goodput totals and stragglers. Pure data, no output."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from elastic_rt.errors import ConfigError
from elastic_rt.goodput.events import FILE_GLOB, read_events
from elastic_rt.goodput.ledger import CATEGORIES

# Events that move an agent into the phase named in their "phase" field.
_PHASE_EVENTS = ("restart", "workers_started", "first_step", "finished")


@dataclass(kw_only=True)
class Session:
    """One agent process: a node's journal lines with the same pid."""

    node: str
    pid: int
    run_id: str
    events: list[dict] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.events[0]["time"]

    @property
    def end(self) -> float:
        return self.events[-1]["time"]

    @property
    def exited(self) -> bool:
        return any(e["event"] == "exit" for e in self.events)

    @property
    def final_state(self) -> str:
        finished = [e["state"] for e in self.events if e["event"] == "finished"]
        if finished:
            return finished[-1]
        if any(e["event"] == "straggler" and e.get("action") == "leave" for e in self.events):
            return "left (straggler)"
        return "stopped" if self.exited else "no exit line (killed?)"

    def totals(self) -> tuple[dict[str, float], float, float]:
        """(seconds per category, uncommitted seconds, seconds after them) from the last totals or exit
        line; the seconds after are those an agent killed before its exit line could not count."""
        for e in reversed(self.events):
            if e["event"] in ("exit", "totals"):
                return ({c: float(e["totals"].get(c, 0.0)) for c in CATEGORIES}, float(e.get("uncommitted_s", 0.0)),
                        max(0.0, self.end - e["time"]))
        return dict.fromkeys(CATEGORIES, 0.0), 0.0, max(0.0, self.end - self.start)

    def segments(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) in Unix time; the lost tail of a failed generation as phase "lost"."""
        out: list[tuple[str, float, float]] = []
        phase, since = "startup", self.start
        def retag_tail(seconds: float, tag: str) -> None:  # the end of the last training segment
            for i in range(len(out) - 1, -1, -1):
                p, a, b = out[i]
                if p == "training":
                    cut = max(a, b - seconds)
                    out[i:i + 1] = [s for s in (("training", a, cut), (tag, cut, b)) if s[2] > s[1]]
                    return

        for e in self.events:
            if e["event"] in _PHASE_EVENTS and e.get("phase") and e["phase"] != phase:
                if e["time"] > since:
                    out.append((phase, since, e["time"]))
                phase, since = e["phase"], e["time"]
            if e["event"] in ("lost", "exit") and phase == "training":  # the agent stopped its workers
                out.append((phase, since, e["time"]))
                phase, since = "other", e["time"]
            if e["event"] == "lost" and e.get("seconds", 0) > 0:
                retag_tail(float(e["seconds"]), "lost")
            elif e["event"] == "finished" and e.get("after_last_step_s", 0) > 0:
                retag_tail(float(e["after_last_step_s"]), "other")
        if self.end > since:
            out.append((phase, since, self.end))
        merged: list[tuple[str, float, float]] = []
        for seg in out:
            if merged and merged[-1][0] == seg[0] and merged[-1][2] == seg[1]:
                merged[-1] = (seg[0], merged[-1][1], seg[2])
            else:
                merged.append(seg)
        return merged


@dataclass(frozen=True, kw_only=True)
class Incident:
    """Restarts on one or more nodes that overlap: one disruption of the job."""

    start: float
    back: float | None  # when the last of those nodes trained again (None: it never did)
    causes: tuple[tuple[str, str], ...]  # (node, reason)
    lost_steps: int
    lost_s: float  # node-seconds of training thrown away

    @property
    def recovery_s(self) -> float | None:
        return None if self.back is None else self.back - self.start


@dataclass(kw_only=True)
class Timeline:
    sessions: list[Session]
    sources: list[str]

    @property
    def start(self) -> float:
        return min(s.start for s in self.sessions)

    @property
    def end(self) -> float:
        return max(s.end for s in self.sessions)

    @property
    def run_ids(self) -> list[str]:
        return sorted({s.run_id for s in self.sessions})

    @property
    def nodes(self) -> list[str]:
        return sorted({s.node for s in self.sessions})

    def events(self, *names: str) -> list[tuple[Session, dict]]:
        out = [(s, e) for s in self.sessions for e in s.events if not names or e["event"] in names]
        return sorted(out, key=lambda se: se[1]["time"])

    def incidents(self) -> list[Incident]:
        items = []  # (time, back, node, reason, lost steps, lost s)
        for s in self.sessions:
            evs = s.events
            for i, e in enumerate(evs):
                if e["event"] != "restart":
                    continue
                back = next((x["time"] for x in evs[i + 1:] if x["event"] == "first_step"), None)
                lost = next((x for x in evs[i + 1:] if x["event"] in ("lost", "restart")), None)
                lost = lost if lost is not None and lost["event"] == "lost" else {}
                reason = e.get("reason", "?")
                failures = []  # classified failures logged since the previous restart, newest last
                for x in reversed(evs[:i]):
                    if x["event"] in ("restart", "workers_started"):
                        break
                    if x["event"] == "failure":
                        failures.insert(0, f"rank {x.get('rank', '?')} {x.get('cause', '')}".strip())
                if failures:
                    reason = f"{reason} ({'; '.join(failures)})"
                items.append((e["time"], back, s.node, reason, int(lost.get("steps", 0)),
                              float(lost.get("seconds", 0.0))))
        items.sort(key=lambda x: x[0])
        incidents: list[Incident] = []
        group: list[tuple] = []

        def close() -> None:
            if group:
                backs = [g[1] for g in group]
                incidents.append(Incident(
                    start=group[0][0], back=None if None in backs else max(backs),
                    causes=tuple((g[2], g[3]) for g in group), lost_steps=max(g[4] for g in group),
                    lost_s=sum(g[5] for g in group)))

        for item in items:
            if group:
                ends = [g[1] if g[1] is not None else float("inf") for g in group]
                if item[0] > max(ends):
                    close()
                    group = []
            group.append(item)
        close()
        return incidents

    def world_sizes(self) -> list[tuple[float, int]]:
        """(time, workers in the job) steps: a round's size from its rendezvous, 0 while restarting."""
        points: list[tuple[float, int]] = []
        for _, e in self.events("rendezvous", "restart", "exit"):
            size = int(e.get("world_size", 0)) if e["event"] == "rendezvous" else 0
            if e["event"] == "exit" and e["time"] < self.end:
                continue  # a node that left early: the others go on
            points.append((e["time"], size))
        return points

    def totals(self) -> tuple[dict[str, float], float, float, int]:
        """Node-seconds per category over all agents, uncommitted node-seconds, node-seconds after the last
        totals of agents without an exit line, and how many such agents there are."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        uncommitted = unaccounted = 0.0
        for s in self.sessions:
            totals, pending, after = s.totals()
            for c in CATEGORIES:
                out[c] += totals[c]
            uncommitted += pending
            unaccounted += after
        return out, uncommitted, unaccounted, sum(not s.exited for s in self.sessions)


def find_journals(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: no such file or directory")
    found = sorted(glob.glob(os.path.join(path, "**", FILE_GLOB), recursive=True))
    if not found:
        raise ConfigError(f"no {FILE_GLOB} under {path}: point at an agent's --log-dir (or a directory of several)")
    return found


def load(paths: list[str]) -> Timeline:
    """Read every journal under `paths` into one timeline (sessions keyed by node and pid)."""
    sources = list(dict.fromkeys(os.path.realpath(j) for p in paths for j in find_journals(p)))
    sessions: dict[tuple[str, int], Session] = {}
    for path in sources:
        try:
            events = list(read_events(path))
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
        for e in events:
            key = (str(e.get("node", "?")), int(e.get("pid", 0)))
            s = sessions.setdefault(key, Session(node=key[0], pid=key[1], run_id=str(e.get("run_id", "?"))))
            s.events.append(e)
    found = [s for s in sessions.values() if s.events]
    if not found:
        raise ConfigError(f"no events in {', '.join(sources)}")
    for s in found:
        s.events.sort(key=lambda e: e["time"])
    return Timeline(sessions=sorted(found, key=lambda s: (s.start, s.node)), sources=sources)
