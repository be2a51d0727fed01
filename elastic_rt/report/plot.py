"""--plot: each agent's phases as coloured bars over time, the job's world size below (matplotlib)."""

from __future__ import annotations

from elastic_rt.errors import ConfigError
from elastic_rt.report.timeline import Timeline

COLORS = {
    "training": "#2ca02c", "startup": "#7f7f7f", "restart": "#d62728", "restore": "#ff7f0e",
    "lost": "#9467bd", "other": "#c7c7c7",
}
LABELS = {
    "training": "training", "startup": "startup", "restart": "rendezvous / restart", "restore": "restore",
    "lost": "progress lost", "other": "other",
}


def plot(timeline: Timeline, path: str) -> None:
    """Write a PNG of the timeline to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'elastic-rt[plot]'") from exc

    t0 = timeline.start
    sessions = timeline.sessions
    fig, (ax, ax_world) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 2.2 + 0.45 * len(sessions)),
        gridspec_kw={"height_ratios": [max(1.5, 0.45 * len(sessions)), 1.2]})
    for y, s in enumerate(sessions):
        for phase, a, b in s.segments():
            ax.broken_barh([(a - t0, b - a)], (y - 0.35, 0.7), facecolors=COLORS.get(phase, "#000000"),
                           hatch="//" if phase == "lost" else None, edgecolor="white" if phase == "lost" else None)
        for e in s.events:
            if e["event"] == "checkpoint":
                ax.plot([e["time"] - t0], [y + 0.42], marker="v", color="#1f77b4", markersize=4)
            elif e["event"] == "straggler":
                ax.plot([e["time"] - t0], [y], marker="*", color="black", markersize=11)
    ax.set_yticks(range(len(sessions)))
    ax.set_yticklabels([s.node if sum(x.node == s.node for x in sessions) == 1 else f"{s.node} ({s.pid})"
                        for s in sessions])
    ax.invert_yaxis()
    ax.set_title(f"elastic-rt run {', '.join(timeline.run_ids)}")
    handles = [Patch(facecolor=COLORS[p], label=LABELS[p], hatch="//" if p == "lost" else None) for p in COLORS]
    handles.append(plt.Line2D([], [], marker="v", color="#1f77b4", linestyle="", label="checkpoint"))
    handles.append(plt.Line2D([], [], marker="*", color="black", linestyle="", label="straggler"))
    fig.legend(handles=handles, loc="lower center", ncol=8, fontsize=8, frameon=False)

    points = timeline.world_sizes()
    if points:
        xs = [p[0] - t0 for p in points] + [timeline.end - t0]
        ys = [p[1] for p in points] + [points[-1][1]]
        ax_world.step(xs, ys, where="post", color="#1f77b4")
        ax_world.fill_between(xs, ys, step="post", alpha=0.2, color="#1f77b4")
    ax_world.set_ylabel("world size")
    ax_world.set_xlabel("seconds since the first agent started")
    ax_world.set_ylim(bottom=0)
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
