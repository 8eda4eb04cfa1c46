"""Collect the inputs, build the sections, render and write the page."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..files import read_json, write_text


def default_out(name: str = "report") -> Path:
    """``reports/<name>-<time>-<pid>.html``: two reports made in one second do not overwrite each other."""
    return Path("reports") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.html"


def _load(path: Path) -> dict[str, Any]:
    """A --bench/--tune input; what is wrong with it is a usage error (exit 2)."""
    try:
        data = read_json(path)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a tunelab --json result")
    return data


def _labels(paths: list[Path], datas: list[dict[str, Any]]) -> list[str]:
    """Host names when they tell the inputs apart, else file names."""
    hosts = [str((d.get("hardware") or {}).get("hostname", "")) for d in datas]
    if all(hosts) and len(set(hosts)) == len(hosts):
        return [f"{h} ({p.name})" for h, p in zip(hosts, paths)]
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


@contextlib.contextmanager
def _naming(what: str, expected: str) -> Iterator[None]:
    """A field of ``what`` missing or of the wrong type or value: one line naming it (exit 2)."""
    try:
        yield
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, OverflowError) as exc:
        said = " ".join(str(exc).split())  # (one line, whatever the message held)
        raise UsageError(f"{what}: malformed input ({type(exc).__name__}: {said}); expected {expected}") from None


def build_html(title: str, profiles: list[int], benches: list[Path], tunes: list[Path],
               store: Any | None = None) -> str:
    from .bench import bench_sections
    from .runs import run_from_json, run_from_profile
    from .template import render
    from .tuning import tuning_section

    sections: list = []
    for p in tunes:
        with _naming(f"--tune {p}", "the --json of tunelab tune"):
            sections.append(tuning_section(run_from_json(p.name, _load(p)), len(sections)))
    for i in profiles:
        with _naming(f"--profile {i}", "a profile of the store"):
            sections.append(tuning_section(run_from_profile(i, store), len(sections)))
    if benches:
        bench_data = [_load(p) for p in benches]
        with _naming("--bench " + ", ".join(map(str, benches)), "the --json of a tunelab bench command"):
            sections += bench_sections(list(zip(_labels(benches, bench_data), bench_data)))
    sources = [p.name for p in tunes + benches] + [f"profile {i}" for i in profiles]
    return render({"title": title, "sections": sections, "sources": sources,
                   "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")})


def write_report(out: Path, title: str, profiles: list[int], benches: list[Path], tunes: list[Path],
                 store: Any | None = None) -> Path:
    html = build_html(title, profiles, benches, tunes, store)
    return write_text(out, html)
