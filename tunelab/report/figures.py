"""Figure helpers: matplotlib (Agg) figures rendered to PNG data URIs."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any


def new_figure(width: float = 7.0, height: float = 4.0) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot(1, 1, 1)


def to_data_uri(fig: Any) -> str:
    """The figure as a base64 PNG ``data:`` URI (no metadata, so no URLs inside).  Every text is drawn as
    written: labels come from file names, host names and models, and matplotlib would read ``$...$`` in
    them as math (an unbalanced ``$`` fails the whole report).  Except the tick labels matplotlib writes
    as math itself (a log axis' ``$\\mathdefault{2^{10}}$``), found once the ticks are laid out."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_parse_math(False)
    fig.draw_without_rendering()  # (the ticks' labels exist once laid out; later draws reuse them)
    for text in fig.findobj(Text):
        label = text.get_text()
        text.set_parse_math(label.startswith("$\\mathdefault{") and label.endswith("$"))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def line_chart(series: dict[str, tuple[Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
               logx: bool = False, step: bool = False) -> str:
    fig, ax = new_figure()
    for label, (xs, ys) in series.items():
        if step:
            ax.step(xs, ys, where="post", label=label)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    return to_data_uri(fig)


def grouped_bars(groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> str:
    """One group of bars per entry of ``groups``, one bar per series within a group."""
    fig, ax = new_figure()
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return to_data_uri(fig)


def ranked_points(labels: Sequence[str], visits: Sequence[Sequence[float]], highlight: int | None,
                  xlabel: str) -> str:
    """One row per point, first at the top: a bar to its mean over ``visits`` and a dot for each visit;
    the ``highlight`` row (the default) in another colour."""
    n = max(1, len(labels))
    fig, ax = new_figure(7.0, max(2.5, 0.28 * n + 1.0))
    for i, scores in enumerate(visits):
        y = n - 1 - i
        colour = "tab:orange" if i == highlight else "tab:blue"
        ax.barh(y, sum(scores) / len(scores), color=colour, alpha=0.45, height=0.7)
        ax.plot(list(scores), [y] * len(scores), "o", color=colour, markersize=3)
    ax.set_yticks([n - 1 - i for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize="x-small")
    lows = [min(v) for v in visits if v]
    if lows:
        ax.set_xlim(left=0.95 * min(lows))
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    return to_data_uri(fig)


def convergence(scores: Sequence[float], phases: Sequence[str], default_score: float) -> str:
    fig, ax = new_figure()
    xs = list(range(len(scores)))
    colours = {"default": "tab:gray", "explore": "tab:blue", "remeasure": "tab:orange"}
    for phase in dict.fromkeys(phases):
        idx = [i for i in xs if phases[i] == phase]
        ax.scatter(idx, [scores[i] for i in idx], color=colours.get(phase, "tab:purple"), label=phase, zorder=3)
    # The default's blocks joined up: the host's drift, which every candidate is scored against (a raw
    # "best so far" would crown whichever block the host happened to run fastest, a reference included).
    refs = [i for i in xs if phases[i] == "default"]
    if len(refs) > 1:
        ax.plot(refs, [scores[i] for i in refs], color="tab:gray", linewidth=1, label="default over time (drift)")
    ax.axhline(default_score, color="tab:gray", linestyle="--", label="default (mean)")
    ax.set_xlabel("sample")
    ax.set_ylabel("samples/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return to_data_uri(fig)


def heatmap(xs: Sequence[float], ys: Sequence[float], z: Any, points: Sequence[tuple[float, float]],
            xlabel: str, ylabel: str, zlabel: str, xticks: Sequence[tuple[float, str]] = ()) -> str:
    fig, ax = new_figure(7.0, 4.5)
    mesh = ax.pcolormesh(xs, ys, z, shading="auto", cmap="viridis")
    bar = fig.colorbar(mesh, ax=ax, label=zlabel)
    bar.formatter.set_useOffset(False)
    bar.update_ticks()
    if points:
        px, py = zip(*points)
        ax.scatter(px, py, c="white", edgecolors="black", s=40, label="samples")
        ax.scatter(px[:1], py[:1], c="red", edgecolors="black", s=60, marker="s", label="default")
        ax.legend(fontsize="small", loc="upper right")
    ax.set_yscale("log")
    if xticks:
        ax.set_xticks([x for x, _ in xticks], [label for _, label in xticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return to_data_uri(fig)
