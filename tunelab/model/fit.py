"""Fitting the α-β-γ scale model, and the fitted model itself (saved as JSON).

Every cost formula is linear in the parameters (:mod:`tunelab.model.costs`), so the fit is a
non-negative least-squares problem on **relative** error: each observation's row of coefficients is
divided by its measured time, and the target is 1.  It is made robust by iteratively reweighting
(Huber weights on the relative residual): a point the model cannot explain (a preempted run on a
shared machine) loses its pull instead of bending every parameter.  Parameters no observation
touches are not fitted (predictions that need them say so).  A shaped link's inverse bandwidth is
bounded below by its nominal rate (``link:1gbps.beta`` >= 8 ns per byte): a byte cannot cross faster,
so what the wire does not explain is left to TCP's CPU cost and the contention factor, not to a wire
fitted faster than its shaping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from ..files import read_json, write_text
from ..knobs import Knobs
from .costs import (
    BASELINES,
    OVER,
    PLAN_ALPHA,
    TCP_BETA,
    WAKE,
    Topology,
    coefficients,
    contention_key,
    family,
    hidden_s,
    inflated,
    is_wire,
    refills,
    seconds,
    wire_s,
)
from .data import ModelInputError, Observation

FORMAT = "tunelab-scale-model/3"  # /2: one cost per call (no plan.alpha); /1: latencies inflated by a factor
PER_CALL_FORMAT = "tunelab-scale-model/2"
HUBER_REL = 0.10       # residuals beyond 10 % count linearly, not quadratically
MIN_EXTRA_POINTS = 2   # points beyond the number of fitted parameters
HIDDEN_ROUNDS = 8      # fits at most, while the forms a token bucket gives the calls settle


class ModelError(UsageError):
    """A prediction the model cannot make (a link or algorithm it was not fitted for)."""


@dataclass
class ScaleModel:
    """Fitted parameter values (seconds, seconds per byte) and what they were fitted on."""

    values: dict[str, float]
    points: int = 0
    sources: list[str] = field(default_factory=list)
    rel_errors: dict[str, float] = field(default_factory=dict)  # training: median / p90 / max |error|
    fit_points: list[dict[str, Any]] = field(default_factory=list)  # training: measured vs predicted

    def __post_init__(self) -> None:
        if any(k.startswith("link:") for k in self.values):
            # a model fitted without oversubscribed runs (or before TCP's CPU cost was its own
            # parameter) has that cost inside the link's beta
            self.values.setdefault(TCP_BETA, 0.0)

    @property
    def links(self) -> list[str]:
        return sorted({_owner(k)[5:] for k in self.values if k.startswith("link:")})

    @property
    def baselines(self) -> list[str]:
        """Fitted baselines: ``mpi`` (not behind a link) or ``mpi@<link>`` (through it), and gloo's."""
        return sorted({_family_of(k) for k in self.values
                       if OVER not in k
                       and not k.startswith(("link", "shm.", "gamma", "tcp.", "call.", "plan."))})

    def time_s(self, algorithm: str, topo: Topology, size: int, knobs: Knobs | None = None,
               route: str = "call") -> float:
        """Predicted seconds of one allreduce (``route``: a single tensor's ``call`` or a coordinator's
        fused ``bucket``, see :func:`~tunelab.model.costs.coefficients`).  ModelError when a parameter it
        needs was not fitted."""
        coeffs = coefficients(algorithm, topo, size, knobs or Knobs(), route)
        missing = [k for k in coeffs if k not in self.values]
        if missing:
            raise ModelError(f"the model has no fitted {missing[0]} (needed by {algorithm} on {topo.describe()}); "
                             f"fit it with bench runs of that kind (fitted links: {', '.join(self.links) or 'none'})")
        total = seconds(coeffs, self.values, family(algorithm, topo), topo.over)
        return total - hidden_s(total, wire_s(coeffs, self.values), topo.burst_s * refills(algorithm, topo, size, knobs or Knobs()))

    def can_predict(self, algorithm: str, topo: Topology) -> bool:
        try:
            self.time_s(algorithm, topo, 1 << 20)
        except ModelError:
            return False
        return True

    def with_link(self, name: str, gbps: float) -> ScaleModel:
        """A copy that also knows a link of ``gbps`` not measured: its latency is the fitted link's,
        its inverse bandwidth the fitted link's scaled by their nominal speeds (the same efficiency).
        Baselines fitted through that link (``mpi@<link>``) are carried over too: their own latency and
        per-byte work as fitted, their bytes on the wire at the new link's speed."""
        if name in self.links:
            return self
        ref = _nearest_link(self.links, gbps)
        if ref is None:
            raise ModelError("the model has no fitted link between hosts to derive another from")
        values = dict(self.values)
        src = f"link:{ref[0]}"
        for key in [k for k in self.values if k.startswith(src + ".")]:
            new = key.replace(src, f"link:{name}", 1)
            values[new] = values[key] * (ref[1] / gbps if ".beta" in key else 1.0)
        through = {f"{b}@{ref[0]}" for b in BASELINES}  # e.g. mpi@1gbps, its wake-up and its ~over factor
        for key in [k for k in self.values if _family_of(k) in through]:
            values[key.replace(f"@{ref[0]}", f"@{name}", 1)] = values[key]
        return ScaleModel(values, self.points, self.sources, self.rel_errors, self.fit_points)

    def for_link(self, link_gbps: float | None) -> tuple[ScaleModel, str]:
        """The model and the link name for a topology between hosts: ``link_gbps`` (derived from the
        nearest fitted link when not fitted itself), else the model's one fitted link; ModelError (a
        usage error) when that is ambiguous."""
        from .costs import link_name

        if not self.links:  # (giving --link-gbps would not help: there is no link to derive it from)
            raise ModelError("the model was fitted on runs within one host: it has no link between hosts "
                             "to predict across (fit it on runs of 2 or more hosts, e.g. on the lab)")
        if link_gbps is not None:
            link = link_name(link_gbps)
            return self.with_link(link, link_gbps), link
        if len(self.links) == 1:
            return self, self.links[0]
        raise ModelError(f"give --link-gbps: the model has links {', '.join(self.links)}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "values": self.values, "points": self.points, "sources": self.sources,
                "rel_errors": self.rel_errors, "fit_points": self.fit_points}

    def save(self, path: Path) -> None:
        write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ScaleModel:
        try:
            doc = read_json(path)
        except FileNotFoundError:
            raise ModelInputError(f"{path}: no such model file") from None
        except (OSError, ValueError) as exc:
            raise ModelInputError(f"{path}: not a model file ({exc})") from None
        if isinstance(doc, dict) and doc.get("format") == "tunelab-scale-model/1":
            raise ModelInputError(f"{path}: fitted by an older tunelab (format tunelab-scale-model/1, whose "
                                  f"latencies scale differently); fit it again with `tunelab model fit`")
        if not isinstance(doc, dict) or doc.get("format") not in (FORMAT, PER_CALL_FORMAT) \
                or not isinstance(doc.get("values"), dict):
            raise ModelInputError(f"{path}: not a tunelab model file (expected format {FORMAT})")
        values = _parameters(path, doc["values"])
        if doc["format"] == PER_CALL_FORMAT and "call.alpha" in values:
            # one cost per call, fitted on runs of the general path: its planning and its agreement
            # together, what a coordinator's bucket pays as well as a call of the general path
            values[PLAN_ALPHA] = values.pop("call.alpha")
            values["call.alpha"] = 0.0
        shapes = {"points": int, "sources": list, "rel_errors": dict, "fit_points": list}
        wrong = [k for k, kind in shapes.items() if k in doc and (not isinstance(doc[k], kind) or isinstance(doc[k], bool))]
        if wrong:
            raise ModelInputError(f"{path}: damaged model file ({wrong[0]} is not {shapes[wrong[0]].__name__}); "
                                  "fit it again with `tunelab model fit`")
        # what the fit printed of itself: a count of points, the files' names, its errors as numbers
        why = ("points is not a count of 0 .. 1e9" if not 0 <= doc.get("points", 0) <= 10 ** 9 else
               "sources are not all file names" if not all(isinstance(s, str) for s in doc.get("sources", [])) else
               "rel_errors are not all numbers >= 0" if not all(
                   isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in doc.get("rel_errors", {}).values()) else "")
        if why:
            raise ModelInputError(f"{path}: damaged model file ({why}); fit it again with `tunelab model fit`")
        points = list(doc.get("fit_points", []))
        for i, point in enumerate(points):
            why = _point_defect(point)
            if why:
                raise ModelInputError(f"{path}: damaged model file (fit_points[{i}] {why}); "
                                      "fit it again with `tunelab model fit`")
        return cls(values, int(doc.get("points", 0)), list(doc.get("sources", [])), dict(doc.get("rel_errors", {})),
                   points)


# what a fitted point of a model file holds (the report plots them; the fit prints them)
_POINT_TEXT = ("source", "algorithm", "link")
_POINT_COUNTS = ("size", "hosts", "ranks_per_host", "segment_bytes")
_POINT_TIMES = ("measured_s", "predicted_s")


def _point_defect(point: Any) -> str:
    """Why ``point`` is not a fitted point as :func:`relative_errors` writes one ("" if it is one)."""
    if not isinstance(point, dict):
        return f"is {type(point).__name__}, not an object"
    for key in _POINT_TEXT:
        if not isinstance(point.get(key), str):
            return f"has no text {key}"
    for key in _POINT_COUNTS:
        v = point.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"has no whole number >= 1 for {key}"
    for key in (*_POINT_TIMES, "rel_error"):
        v = point.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (key in _POINT_TIMES and v <= 0):
            return f"has no {'time > 0' if key in _POINT_TIMES else 'finite number'} for {key}"
    return ""


def _parameters(path: Path, raw: dict) -> dict[str, float]:
    """A model file's parameter values: each a finite number >= 0 (every fitted parameter is), and its
    links' speeds positive; ModelInputError naming the first that is not."""
    if not raw:
        raise ModelInputError(f"{path}: the model file has no parameters; fit it again with `tunelab model fit`")
    values = {}
    for key, value in raw.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        if not ok:
            raise ModelInputError(f"{path}: damaged model file: parameter {key} is {value!r}, not a number >= 0")
        most, what = _most(str(key))
        if value > most:
            raise ModelInputError(f"{path}: damaged model file: parameter {key} is {value!r}, more than any fit "
                                  f"gives ({what} of at most {most:g}); fit it again with `tunelab model fit`")
        values[str(key)] = float(value)
    for key in values:
        link = key.removeprefix("link:").split(".")[0]
        if key.startswith("link:") and link.endswith("gbps") and _gbps(link) is None:
            raise ModelInputError(f"{path}: damaged model file: link {link} is not a speed > 0")
    return values


def _most(key: str) -> tuple[float, str]:
    """The largest value a parameter can take in a model file, and what it is: far beyond what any
    machine measures (a second a message, a kilobyte a second), so only an edited or damaged file
    exceeds it, and predictions stay finite up to 1024 ranks."""
    if key.endswith("~over.beta"):
        return 1e3, "a factor"
    if key.endswith(".alpha"):
        return 1.0, "seconds a message"
    return 1e-3, "seconds a byte"


def _gbps(link: str) -> float | None:
    """The speed of a link named ``<G>gbps`` (a finite number > 0), else None."""
    try:
        speed = float(link.removesuffix("gbps"))
    except ValueError:
        return None
    return speed if math.isfinite(speed) and speed > 0 else None


def wire_floor(name: str) -> float:
    """The least a link's ``link:<G>gbps.beta`` can be: 8 / G ns per byte, its nominal rate (0 for any
    other parameter, or a link whose speed is not known)."""
    if not (name.startswith("link:") and name.endswith("gbps.beta")):
        return 0.0
    gbps = _gbps(name[len("link:"):-len(".beta")])
    return 8.0 / (gbps * 1e9) if gbps is not None else 0.0


def _owner(key: str) -> str:
    """``link:1gbps`` of ``link:1gbps.beta``."""
    return key.rsplit(".", 1)[0]


def _family_of(key: str) -> str:
    """Whose parameter a value is: ``mpi@1gbps`` of ``mpi@1gbps.alpha``, ``mpi@1gbps.wake.alpha`` and
    ``mpi@1gbps~over.beta``."""
    return _owner(key).removesuffix(WAKE).removesuffix(OVER)


def _nearest_link(links: list[str], gbps: float) -> tuple[str, float] | None:
    speeds = [(name, speed) for name in links if (speed := _gbps(name)) is not None]
    return min(speeds, key=lambda s: abs(math.log(s[1] / gbps)), default=None)


def fit_model(observations: Sequence[Observation], robust: bool = True) -> ScaleModel:
    """Fit every parameter the observations touch (wake-ups where some observations ran oversubscribed),
    and there each family's contention factor on CPU costs (per byte, and the planning).  ModelInputError
    with too few points."""
    obs = list(observations)
    rows = [coefficients(o.algorithm, o.topo, o.size, o.knobs) for o in obs]
    merged = _merge_call_into_plan(rows)
    names = sorted({k for r in rows for k, v in r.items() if v})
    fams = [family(o.algorithm, o.topo) for o in obs]
    n_params = len(names) + len({f for f, o in zip(fams, obs) if o.topo.over > 0})
    if not obs or len(obs) < n_params + MIN_EXTRA_POINTS:
        raise ModelInputError(f"too few points to fit: {len(obs)} measured allreduces for {n_params} "
                              f"parameters (need at least {n_params + MIN_EXTRA_POINTS}); add sizes or runs")
    # A token-bucket link (the lab's) hides part of each call under its wire time (costs.hidden_s): a
    # call takes max(wire, other, other + wire - burst), each form linear in the parameters.  Fit with
    # every point's form fixed (first the plain sum), find which form each point takes under the values
    # found, fit again, until no point changes form; the fit whose own predictions are best is kept.
    forms = ["sum"] * len(obs)
    best: tuple[float, ScaleModel] | None = None
    for _ in range(HIDDEN_ROUNDS if any(o.topo.burst_s > 0 for o in obs) else 1):
        design, shift = zip(*(_form_of(r, f, o) for r, f, o in zip(rows, forms, obs)))
        values = _fit_values(obs, rows, fams, list(design), np.array(shift), robust)
        if merged:
            values["call.alpha"] = 0.0
        candidate = ScaleModel(values, len(obs), sorted({o.source for o in obs}))
        rel = np.array([candidate.time_s(o.algorithm, o.topo, o.size, o.knobs) / o.time_s - 1.0 for o in obs])
        loss = _huber_loss(rel)
        if best is None or loss < best[0]:
            best = (loss, candidate)
        new = [_form_taken(r, values, f, o) for r, f, o in zip(rows, fams, obs)]
        if new == forms:
            break
        forms = new
    model = best[1]
    model.fit_points = relative_errors(model, obs)
    errs = np.abs([e["rel_error"] for e in model.fit_points])
    model.rel_errors = {"median": float(np.median(errs)), "p90": float(np.percentile(errs, 90)), "max": float(errs.max())}
    return model


def _merge_call_into_plan(rows: list[dict[str, float]]) -> bool:
    """Where every call that pays an agreement (``call.alpha``) also pays the general path's planning
    (``plan.alpha``) and the other way round (no short route between hosts was measured: one host's
    short route pays neither), the two cannot be told apart: fit them as one, ``plan.alpha`` (what a
    coordinator's bucket pays too), with ``call.alpha`` 0.  Edits ``rows`` in place; True if merged."""
    touched = [r for r in rows if r.get("call.alpha") or r.get(PLAN_ALPHA)]
    if not touched or any(r.get("call.alpha", 0.0) != r.get(PLAN_ALPHA, 0.0) for r in touched):
        return False
    for r in touched:
        r.pop("call.alpha", None)
    return True


def _form_of(row: dict[str, float], form: str, o: Observation) -> tuple[dict[str, float], float]:
    """The coefficients of the form ``form`` of a call's time (``sum``, ``wire``, ``other``, or ``bucket``:
    the sum less a bucket's worth) and the seconds to add to its measured time (the bucket's)."""
    if form == "wire":
        return {k: v for k, v in row.items() if is_wire(k)}, 0.0
    if form == "other":
        return {k: v for k, v in row.items() if not is_wire(k)}, 0.0
    return row, (_burst_s(o) if form == "bucket" else 0.0)


def _burst_s(o: Observation) -> float:
    """What a token-bucket link can hide of the observed call: its bucket, once per refill."""
    return o.topo.burst_s * refills(o.algorithm, o.topo, o.size, o.knobs)


def _form_taken(row: dict[str, float], values: dict[str, float], fam: str, o: Observation) -> str:
    """Which form a call's predicted time takes under ``values`` (see :func:`costs.hidden_s`)."""
    total, wire, burst = seconds(row, values, fam, o.topo.over), wire_s(row, values), _burst_s(o)
    other = total - wire
    if burst <= 0.0 or wire <= 0.0 or other <= 0.0:
        return "sum"
    if other <= min(wire, burst) and o.time_s <= wire * (1.0 + HUBER_REL):
        return "wire"    # all of the rest hides under the wire
    # all the wire hides; or a bucket's worth of it.  (A call measured clearly slower than its wire is not
    # hiding its rest under it, whatever the values so far say: taken in the wire's form its latencies
    # would have no pull on the fit, and a latency that came out low once would stay there.)
    return "other" if wire <= burst else "bucket"


def _fit_values(obs: list[Observation], rows: list[dict[str, float]], fams: list[str],
                design: list[dict[str, float]], shift: np.ndarray, robust: bool) -> dict[str, float]:
    """One fit of every family's parameters (those ``rows`` name) to each call's measured time plus
    ``shift``, through the coefficients of ``design`` (each call's form)."""
    values: dict[str, float] = {}
    # The engine first: it owns the link's parameters, which a baseline through the same link shares
    # (its bytes take the same wire's time); a later family takes them as fitted, not as its own.
    for fam in sorted(dict.fromkeys(fams), key=lambda f: f != "engine"):
        idx = [i for i, f in enumerate(fams) if f == fam]
        mine = sorted({k for i in idx for k in rows[i]})
        over = np.array([obs[i].topo.over for i in idx])
        if over.max() == 0 and TCP_BETA in mine and TCP_BETA not in values:
            # TCP's CPU cost per byte goes with the same bytes as the wire's; only oversubscription
            # (which slows the CPU, not the wire) tells them apart: without it, the link's beta holds both.
            mine.remove(TCP_BETA)
            values[TCP_BETA] = 0.0
        free = [n for n in mine if n not in values]
        times = np.array([obs[i].time_s for i in idx])
        a = np.array([[design[i].get(n, 0.0) for n in free] for i in idx]) / times[:, None]
        fixed = np.zeros((len(idx), 2))  # per observation: what fitted parameters explain (not inflated, inflated)
        fixed[:, 0] -= shift[idx] / times  # ... and what a bucket hid is to be explained too
        for n in (n for n in mine if n in values):
            fixed[:, int(inflated(n))] += np.array([design[i].get(n, 0.0) for i in idx]) * values[n] / times
        floor = np.array([wire_floor(n) for n in free])  # a shaped link is no faster than its rate
        fixed[:, 0] += a @ floor
        grows = np.array([inflated(n) for n in free], dtype=bool)
        x, kappa = _fit_family(a, over, grows, robust, fixed)
        values.update(zip(free, map(float, x + floor)))
        if over.max() > 0:
            values[contention_key(fam)] = kappa
    return values


KAPPA_GRID = np.concatenate([[0.0], np.geomspace(0.05, 320.0, 48)])


def _fit_family(a: np.ndarray, over: np.ndarray, grows: np.ndarray, robust: bool,
                fixed: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Parameters and kappa, the factor on CPU costs (per byte, and the planning) (``grows``) per unit of
    oversubscription: kappa by a search on a grid (each grid point a linear problem), the rest by
    robust NNLS on relative error.  ``fixed``: per observation, the relative time that parameters fitted
    before explain (columns: not inflated, inflated by the same factor)."""
    fixed = np.zeros((a.shape[0], 2)) if fixed is None else fixed
    if over.max() == 0:
        return _robust_nnls(a, robust, target=_target(fixed, over, 0.0)), 0.0
    kappa = _best_kappa(a, over, grows, KAPPA_GRID, fixed)
    fine = kappa * np.geomspace(0.8, 1.25, 9)  # then refine around the coarse optimum
    kappa = _best_kappa(a, over, grows, np.append(fine[fine <= KAPPA_GRID[-1]], kappa), fixed)
    scale = _inflation(grows, over, kappa)
    return _robust_nnls(a * scale, robust, target=_target(fixed, over, kappa)), kappa


def _inflation(grows: np.ndarray, over: np.ndarray, kappa: float) -> np.ndarray:
    """Per observation and parameter: ``1 + kappa * over`` for CPU costs (per byte, and the planning), 1
    for the rest."""
    return 1.0 + np.where(grows, kappa, 0.0)[None, :] * over[:, None]


def _target(fixed: np.ndarray, over: np.ndarray, kappa: float) -> np.ndarray:
    """What the free parameters must explain of each observation (relative units: 1 less the fixed part)."""
    return 1.0 - fixed[:, 0] - fixed[:, 1] * (1.0 + kappa * over)


def _best_kappa(a: np.ndarray, over: np.ndarray, grows: np.ndarray, candidates: np.ndarray,
                fixed: np.ndarray) -> float:
    best, arg = math.inf, float(candidates[0])
    for kappa in candidates:
        scaled = a * _inflation(grows, over, kappa)
        target = _target(fixed, over, kappa)
        x = _robust_nnls(scaled, True, iterations=8, target=target)
        loss = _huber_loss(scaled @ x - target)
        if loss < best:
            best, arg = loss, float(kappa)
    return arg


def _robust_nnls(a: np.ndarray, robust: bool, iterations: int = 30, target: np.ndarray | None = None) -> np.ndarray:
    """min sum w (a x - target)^2 over x >= 0 (target: 1 by default), reweighted with Huber weights on
    the residual."""
    from scipy.optimize import nnls

    b = np.ones(a.shape[0]) if target is None else target
    if a.shape[1] == 0:
        return np.zeros(0)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    an = a / scale
    w = np.ones(a.shape[0])
    x = np.zeros(a.shape[1])
    for _ in range(iterations if robust else 1):
        sw = np.sqrt(w)
        x, _ = nnls(an * sw[:, None], b * sw, maxiter=50 * a.shape[1])
        r = np.abs(an @ x - b)
        new = np.where(r <= HUBER_REL, 1.0, HUBER_REL / np.maximum(r, 1e-12))
        if np.allclose(new, w, rtol=1e-4, atol=1e-6):
            break
        w = new
    return x / scale


def _huber_loss(r: np.ndarray) -> float:
    r = np.abs(r)
    return float(np.where(r <= HUBER_REL, 0.5 * r ** 2, HUBER_REL * (r - 0.5 * HUBER_REL)).sum())


def relative_errors(model: ScaleModel, observations: Sequence[Observation],
                    skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Per observation: measured, predicted, (predicted - measured) / measured.  Observations the
    model cannot predict (a baseline fitted only beside emulated nodes, checked on a lab run) are left
    out, and named in ``skipped`` when given; without it, ModelError."""
    out = []
    for o in observations:
        try:
            pred = model.time_s(o.algorithm, o.topo, o.size, o.knobs)
        except ModelError as exc:
            if skipped is None:
                raise
            skipped.append(f"{o.source}: {o.algorithm}: {exc}")
            continue
        out.append({"source": o.source, "algorithm": o.algorithm, "size": o.size, "hosts": o.topo.hosts,
                    "ranks_per_host": o.topo.ranks_per_host, "link": o.topo.link,
                    "segment_bytes": o.knobs.segment_bytes, "measured_s": o.time_s, "predicted_s": pred,
                    "rel_error": (pred - o.time_s) / o.time_s})
    return out
