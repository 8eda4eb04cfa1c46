"""The scale model in the HTML report: measured vs predicted, and the extrapolation to 1024 ranks.

Built from the report package's pieces (:mod:`tunelab.report.figures`, :mod:`tunelab.report.tables`,
:mod:`tunelab.report.template`); matplotlib, pandas and jinja2 are imported only here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import write_text
from ..knobs import Knobs
from ..units import format_size
from .costs import Topology
from .fit import ScaleModel
from .predict import algorithms_for, time_s

EXTRAPOLATION_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BAND = 0.15  # the accuracy goal drawn around the diagonal


def measured_vs_predicted_figure(errors: Sequence[dict[str, Any]]) -> str:
    """Log-log scatter of measured vs predicted seconds, one colour per algorithm, open markers for the
    points the model was fitted on and filled ones for held-out points, with the ±15 % band."""
    from ..report.figures import new_figure, to_data_uri

    fig, ax = new_figure(6.5, 5.0)
    lo = min(min(e["measured_s"], e["predicted_s"]) for e in errors) * 0.7
    hi = max(max(e["measured_s"], e["predicted_s"]) for e in errors) * 1.4
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * (1 - BAND), hi * (1 - BAND)], [lo * (1 + BAND), hi * (1 + BAND)],
                    color="tab:green", alpha=0.15, label=f"±{BAND:.0%}")
    colours = {"flat": "tab:blue", "hierarchical": "tab:orange", "mpi": "tab:red", "gloo": "tab:purple"}
    for algo in dict.fromkeys(e["algorithm"] for e in errors):
        for held in (False, True):
            pts = [e for e in errors if e["algorithm"] == algo and bool(e.get("held_out")) == held]
            if pts:
                ax.scatter([e["measured_s"] for e in pts], [e["predicted_s"] for e in pts], s=28,
                           facecolors=colours.get(algo, "tab:gray") if held else "none",
                           edgecolors=colours.get(algo, "tab:gray"),
                           label=f"{algo} ({'held out' if held else 'fitted'})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured time (s)")
    ax.set_ylabel("predicted time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return to_data_uri(fig)


def extrapolation_figure(model: ScaleModel, ranks_per_host: int, link: str, sizes: Sequence[int],
                         knobs: Knobs | None = None, measured: Sequence[dict[str, Any]] = ()) -> str:
    """Predicted allreduce time vs ranks (hosts x ``ranks_per_host``, up to 1024) for each size and
    algorithm the model knows, with measured points of the same layout."""
    from ..report.figures import new_figure, to_data_uri

    fig, ax = new_figure(7.0, 4.5)
    styles = ["-", "--", ":", "-."]
    for j, size in enumerate(sizes):
        for algo in algorithms_for(model, Topology(2, ranks_per_host, link)):
            xs, ys = [], []
            for p in EXTRAPOLATION_RANKS:
                if p % ranks_per_host or p // ranks_per_host < 2:
                    continue
                xs.append(p)
                ys.append(time_s(model, algo, Topology(p // ranks_per_host, ranks_per_host, link), size, knobs))
            if xs:
                ax.plot(xs, ys, linestyle=styles[j % len(styles)], label=f"{algo} {format_size(size)}")
        pts = [m for m in measured if m["size"] == size and m["ranks_per_host"] == ranks_per_host
               and m["hosts"] > 1 and m.get("link") == link and m["algorithm"] in ("flat", "hierarchical")]
        if pts:
            ax.scatter([m["hosts"] * m["ranks_per_host"] for m in pts], [m["measured_s"] for m in pts],
                       marker="x", color="black", zorder=3,
                       label=f"measured {format_size(size)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"ranks ({ranks_per_host} per host, link {link}, a core per rank)")
    ax.set_ylabel("predicted allreduce time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    return to_data_uri(fig)


def model_section(model: ScaleModel, errors: Sequence[dict[str, Any]], ranks_per_host: int,
                  link: str, sizes: Sequence[int], tables: Sequence[tuple[str, list[dict]]] = ()) -> dict[str, Any]:
    """The report section: both figures, the parameters, and any extra tables (caption, rows)."""
    from ..report.tables import table_block

    blocks: list[dict[str, Any]] = []
    if errors:
        blocks.append({"kind": "figure", "id": "fig-model-fit", "uri": measured_vs_predicted_figure(errors),
                       "caption": "scale model: measured vs predicted allreduce time (open: fitted on, filled: held out)"})
    link = link if link != "none" else next(iter(model.links), None)
    if link is not None:
        blocks.append({"kind": "figure", "id": "fig-model-extrapolation",
                       "uri": extrapolation_figure(model, ranks_per_host, link, sizes, measured=errors),
                       "caption": f"scale model: allreduce time extrapolated to {EXTRAPOLATION_RANKS[-1]} ranks "
                                  f"({ranks_per_host} per host, link {link}, a core per rank; crosses: the engine measured "
                                  "on one machine, oversubscribed where it has fewer cores than ranks)"})
    params = [{"parameter": k, "value": v} for k, v in sorted(model.values.items())]
    blocks.append(table_block("fitted parameters (s, s/byte; .wake: s per wait per unit of oversubscription; ~over: inflation of "
                              "CPU costs (per byte, and the planning) per unit of oversubscription)", params))
    for caption, rows in tables:
        if rows:
            blocks.append(table_block(caption, rows))
    return {"id": "scale-model", "title": "Scale model", "blocks": blocks}


def write_model_report(out: Path, section: dict[str, Any], sources: Sequence[str], title: str = "tunelab scale model") -> Path:
    from ..report.template import render

    html = render({"title": title, "sections": [section], "sources": list(sources) or ["the scale model"],
                   "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    write_text(out, html)
    return out
