"""Cost formulas of every allreduce path, written as coefficients of the model's parameters.

Every formula is linear in the parameters, so a predicted time is ``sum(coeff[name] * value[name])``
and fitting is a (non-negative, weighted) linear least-squares problem.  The parameters:

* ``call.alpha`` (s per engine call agreed on its own: agreeing on it across ranks and dispatching it),
  ``plan.alpha`` (s of CPU per call that takes the general path: its fusion plan, staging, packing and
  kernel dispatch; a single small tensor takes a short route without them), ``shm.alpha`` (s per
  ordering point of a node's ranks), ``shm.beta`` (s per byte
  copied through shared memory), ``gamma`` (s per byte of every source a reduction reads);
* ``link.alpha`` (s per message crossing the link between hosts, MPI's own cost included: one value
  for the link type, since shaping a link to another speed changes its rate, not its latency) and
  ``link:<name>.beta`` per link speed (s per byte on the wire of one host's link, which all its ranks
  share), and ``tcp.beta`` (CPU s per byte through a host's link: TCP's and the bridge's own work,
  whatever the link's speed; without oversubscribed runs it cannot be told from the wire's and is 0);
* ``<baseline>.alpha/.beta`` for MPI_Allreduce or gloo, each fitted as its own algorithm (its
  reduction is proportional to the same bytes as its transfers, so it is part of its beta).

Contention: on an oversubscribed machine (the lab and emulated nodes run every rank on one machine)
waits and copies cost more, with ``over = max(0, ranks per machine / cores - 1)``:

* every wait pays a **wake-up**: each latency parameter ``X.alpha`` has a companion ``X.wake.alpha``,
  seconds per wait per unit of ``over`` (a rank that waited for a peer must get a core back, and the
  more ranks share a core, the longer that takes); of a pipelined call's ordering points, only the
  first and the one closing each piece count (:func:`shm_wakes`); a ring step between hosts waits for
  the slowest of its ``hosts`` crossing receivers, so its message's wake-up counts the expected
  longest of that many (:func:`slowest_of`).  It is added, not multiplied: how long a rank
  waits for a core is the scheduler's, not a multiple of what the wait costs on an idle core (in the
  lab an ordering point takes no measurable time with a core per rank and 175 us a unit of
  oversubscription);
* every CPU cost (per byte: copies, reductions, TCP's; not the wire's, ``link:<name>.beta``: a shaped
  link is as slow whoever has the cores; and the general path's ``plan.alpha``, work rather than a
  wait, which has no wake-up) is multiplied by ``1 + kappa * over``, one factor per family (the
  engine; each baseline), ``<family>~over.beta``.

Predictions for real hosts with a core per rank have ``over = 0``: the wake-ups and the factors drop
out.

A link shaped by a token bucket (the lab's ``tc tbf``, ``Topology.burst_s``) hides part of each call
among calls run back to back: the bucket fills while the call waits, so that much of its bytes leaves
at memory speed (:func:`hidden_s`, subtracted from the sum of the terms).  On the hierarchical path it
fills again before every piece (:func:`refills`).  Real links hide nothing.

The engine's paths (:mod:`tunelab.engine.algorithms`, hosts ``N``, ranks per host ``K``, ``P = N K``,
size ``S``, pieces of ``segment_bytes``):

* the route of a call (``route``): a single host tensor (``"call"``, as ``bench allreduce`` times it)
  takes a short route where one exists, a coordinator's fused bucket (``"bucket"``) never does:

  - one host, ``S <= oneshot_max_bytes``, a single tensor: the ranks agree on the call in the barrier
    that publishes their data, so it costs the one-shot below and nothing else;
  - between hosts, the flat path, ``S <= doubling_max_bytes``, a single tensor: ``call.alpha`` (its
    agreement) and recursive doubling straight on the output;
  - every other call on more than one rank: the general path, ``plan.alpha``, plus ``call.alpha`` for
    a single tensor (a bucket was negotiated by the coordinator, costed per cycle by the step model);

  and then by path:
* one host, ``S <= oneshot_max_bytes``: copy in, one ordering point, reduce K sources:
  ``shm.alpha + S shm.beta + K S gamma``;
* one host, larger: two-shot, per piece of ``m`` bytes: ``2 shm.alpha + 2 m shm.beta + m gamma``;
* hierarchical (``N > 1``, ``K > 1``): two-shot, and each piece's shard goes round a ring of N hosts
  (K rings share a host's link): ``+ 2 (N-1) link.alpha + 2 (N-1)/N m (link.beta + tcp.beta)
  + 2 (N-1) m/(K N) gamma``; with ``K = 1`` the engine takes the flat ring instead;
* recursive doubling instead of a ring, for buffers up to ``doubling_max_bytes`` (the flat path's
  bucket, the hierarchical path's shard of a piece): ``floor(log2 R)`` swaps of the whole buffer
  among R ranks, plus a fold and an unfold when R is not a power of two, each a ``link.alpha``; each
  swap whose partner is on another host sends the buffer through the link for every rank of the host
  (the flat path: swaps with partners K or more ranks away, ranks placed host by host), and every swap
  reduces two sources of the buffer;
* flat ring (``N > 1``): pack and unpack ``2 S shm.beta``, then 2 (P-1) steps of chunks ``c = S/P``,
  the reduce-scatter sending ``ceil(c / segment)`` messages a step:
  ``(P-1) (ceil(c/seg) + 1) link.alpha + 2 (P-1) c (link.beta + tcp.beta) + 2 (P-1) c gamma``;
* baselines (recursive halving and doubling, MPICH's large-message allreduce):
  ``2 ceil(log2 P) alpha + 2 (P-1)/P S beta``, where ``beta`` is the baseline's own per-byte work
  (copies, reduction, its transport's CPU); where its bytes cross the link between hosts (real hosts,
  the lab) they also take the wire's time and TCP's CPU time, the engine's ``link:<name>.beta`` and
  ``tcp.beta`` (the same wire, the same kernel stack), for the bytes through each host's link:
  MPI ``2 (N-1)/N S`` (recursive halving pairs ranks on other hosts for only the
  steps whose distance spans a host, with ranks placed host by host; MPICH's node-aware allreduce
  moves the same), gloo's ring over all ranks ``2 (P-1)/P S``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..knobs import Knobs

ENGINE_ALGORITHMS = ("flat", "hierarchical")
BASELINES = ("mpi", "gloo")
OVER = "~over"
WAKE = ".wake"             # X.wake.alpha: the wake-up a wait of X.alpha pays per unit of oversubscription
LINK_ALPHA = "link.alpha"  # one latency for the link type between hosts; its speeds differ in beta
TCP_BETA = "tcp.beta"      # CPU time per byte a rank sends and receives through TCP, whatever the link's speed
PLAN_ALPHA = "plan.alpha"  # CPU time of the general path's fusion plan, staging and dispatch, per call
ROUTES = ("call", "bucket")  # a single tensor (short routes where they apply), a coordinator's fused bucket

Coeffs = dict[str, float]


@dataclass(frozen=True)
class Topology:
    """Where the ranks are: ``hosts`` x ``ranks_per_host``, the link between hosts (a name such as
    ``"1gbps"``), how oversubscribed the machine is (ranks per machine / cores; <= 1: a core each),
    whether the baselines' bytes cross that link too (real hosts and the lab: yes; emulated nodes: no,
    so their MPI and gloo are fitted apart, as ``mpi`` rather than ``mpi@<link>``), and ``burst_s``:
    the seconds of the link's rate that a token bucket in front of it holds (the lab's ``tc tbf``; 0
    for a real link, whose idle time is lost), see :func:`hidden_s`."""

    hosts: int
    ranks_per_host: int
    link: str = "link"
    oversubscription: float = 1.0
    baselines_on_link: bool = True
    burst_s: float = 0.0

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"hosts and ranks_per_host must be >= 1, got {self.hosts} x {self.ranks_per_host}")

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def over(self) -> float:
        return max(0.0, float(self.oversubscription) - 1.0)

    def describe(self) -> str:
        text = f"{self.hosts} host{'s' if self.hosts > 1 else ''} x {self.ranks_per_host} = {self.ranks} ranks"
        if self.hosts > 1:
            text += f", link {self.link}"
        return text + (f", {self.oversubscription:g}x oversubscribed" if self.over > 0 else "")


def link_name(gbps: float | None) -> str:
    """The name a link of ``gbps`` is fitted under (``"link"`` when the speed is not known)."""
    return "link" if gbps is None else f"{float(gbps):g}gbps"


def path_of(algorithm: str, topo: Topology, size: int, knobs: Knobs) -> str:
    """The engine path a bucket takes: ``alone``, ``oneshot``, ``twoshot``, ``hierarchical``, ``flat``
    (as :meth:`tunelab.engine.engine.Engine._run` chooses: hierarchical on hosts of one rank each is
    the flat ring, taken whole)."""
    if topo.ranks == 1:
        return "alone"
    if topo.hosts == 1:
        return "oneshot" if size <= knobs.oneshot_max_bytes else "twoshot"
    if algorithm == "hierarchical" and topo.ranks_per_host == 1:
        return "flat"
    return algorithm


def coefficients(algorithm: str, topo: Topology, size: int, knobs: Knobs, route: str = "call") -> Coeffs:
    """Coefficients of every parameter in the time of one allreduce of ``size`` bytes: the wake-ups of
    an oversubscribed machine included, its factor on CPU costs not (see :func:`seconds`).
    ``algorithm``: ``flat``, ``hierarchical`` (the engine: on one host both are the same path) or a
    baseline name; ``route``: ``call`` (a single tensor) or ``bucket`` (a coordinator's fused bucket)."""
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; choose from {', '.join(ROUTES)}")
    if algorithm in BASELINES:
        base = _baseline(algorithm, family(algorithm, topo), topo, size)
    elif algorithm in ENGINE_ALGORITHMS:
        base = _engine(path_of(algorithm, topo, size, knobs), topo, size, knobs, route)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ENGINE_ALGORITHMS + BASELINES)}")
    if topo.over > 0:
        for name in [k for k in base if parameter_kind(k) == "alpha" and not inflated(k)]:
            waits = shm_wakes(base[name]) if name == "shm.alpha" else base[name]
            if name == LINK_ALPHA and algorithm in ENGINE_ALGORITHMS:
                waits *= slowest_of(ring_waiters(path_of(algorithm, topo, size, knobs), topo, size, knobs))
            _add(base, wake_of(name), waits * topo.over)
    return {k: v for k, v in base.items() if v}


def shm_wakes(points: float) -> float:
    """How many of a call's ``points`` ordering points of a host's ranks pay a wake-up when ranks
    outnumber cores: the first (the ranks arrive from wherever the scheduler left them between calls)
    and, of a pipelined call's pieces (two points each), the one that closes each piece, after its
    reduce and, between hosts, its shard's ring (waits of their own that end at different times).  The
    point that opens a later piece follows only local copies (the previous piece's copy-out and this
    one's copy-in), which the ranks, in step by then, finish nearly together.  So ``pieces + 1``
    rather than ``2 pieces``: fitted per point, 256 KiB pieces on 2 x 4 came out 22-52 % dearer than
    measured (the lab's sweeps run 4 MiB pieces, too few for a fit to tell the two apart)."""
    return points if points <= 2 else 1.0 + points / 2.0


def ring_waiters(path: str, topo: Topology, size: int, knobs: Knobs) -> int:
    """How many ranks of one step between hosts wait on a message from another host, each of which must
    get a core back before the step can end: the flat ring's one receiver a host (``hosts``); a
    hierarchical shard's the same, whether it goes round a ring or by recursive doubling (its
    ``ranks_per_host`` shards run apart until the piece's closing ordering point, which pays a wake-up
    of its own); 1 for every other path: one host, and the flat path's recursive doubling of a small
    tensor, left at one wait (counting ``hosts`` there too moved one point of the lab checks into 15 %
    and their crossovers by at most 0.05 of a factor)."""
    if path == "hierarchical" or (path == "flat" and size > knobs.doubling_max_bytes):
        return topo.hosts
    return 1


def slowest_of(waiters: int) -> float:
    """The expected longest of ``waiters`` independent waits for a core, in units of one wait's mean:
    the harmonic number ``1 + 1/2 + ... + 1/waiters`` (the maximum of exponential waits; 1.5 for two
    hosts, 2.08 for four).  A ring step ends when its last crossing receiver has run, so on four hosts
    a step's wake-up costs more than on two at the same number of ranks a core: in the lab's sweeps of
    2026-11-27 the flat ring on 4 x 2 took 1.09-1.19 times its 2 x 4 time from 64 KiB to 4 MiB."""
    return sum(1.0 / i for i in range(1, max(1, waiters) + 1))


def wake_of(name: str) -> str:
    """``shm.wake.alpha`` of ``shm.alpha``: its wake-up per unit of oversubscription."""
    return name.removesuffix(".alpha") + WAKE + ".alpha"


def family(algorithm: str, topo: Topology) -> str:
    """Whose contention factors apply: ``engine``, or the baseline's parameter owner (``mpi``, or
    ``mpi@<link>`` when its bytes cross the link)."""
    if algorithm not in BASELINES:
        return "engine"
    return f"{algorithm}@{topo.link}" if topo.baselines_on_link and topo.hosts > 1 else algorithm


def contention_key(fam: str) -> str:
    """The value name of a family's inflation of CPU costs (per byte, and the planning) per unit of
    oversubscription."""
    return f"{fam}{OVER}.beta"


def seconds(coeffs: Coeffs, values: dict[str, float], fam: str, over: float) -> float:
    """``sum(coeff * value * (1 + kappa * over))``, kappa the family's for CPU costs (per byte, and the
    planning) and 0 for the rest (latencies and their wake-ups, the wire); KeyError naming the first parameter the
    values lack."""
    kappa = values.get(contention_key(fam), 0.0)
    total = 0.0
    for name, c in coeffs.items():
        total += c * values[name] * (1.0 + kappa * over if inflated(name) else 1.0)
    return total


def is_wire(name: str) -> bool:
    """Whether a parameter is a shaped link's time per byte on the wire, ``link:<name>.beta``."""
    return name.startswith("link:") and name.endswith(".beta")


def wire_s(coeffs: Coeffs, values: dict[str, float]) -> float:
    """The part of a predicted time spent on the wire between hosts (``link:<name>.beta`` terms)."""
    return sum(c * values[name] for name, c in coeffs.items() if is_wire(name))


def refills(algorithm: str, topo: Topology, size: int, knobs: Knobs) -> int:
    """How many times in one call a host's link idles long enough for a token bucket to fill: once,
    before the call; on the hierarchical path before each of its pieces, since a piece's shard rings
    start only when the host's ranks have passed its shared-memory phases (copy in, ordering point,
    reduce), while none of them sends.  On the lab's 1 Gb/s links with ``segment_bytes`` 256 KiB
    (64 pieces at 16 MiB) that is up to 64 buckets, 12.6 ms, of a call of 180-440 ms."""
    if algorithm in ENGINE_ALGORITHMS and path_of(algorithm, topo, size, knobs) == "hierarchical":
        return -(-size // max(1, knobs.segment_bytes))
    return 1


def hidden_s(total_s: float, wire: float, burst_s: float) -> float:
    """What a token-bucket link hides of one call among calls run back to back: while the call waits
    and computes (everything but its wire time) the bucket fills again, up to ``burst_s`` of the
    link's rate, and that much of its bytes then leaves at memory speed.  So the call takes
    ``max(wire, other, other + wire - burst_s)`` rather than ``other + wire``; this returns the
    difference, ``min(other, wire, burst_s)`` (0 on a real link, ``burst_s`` = 0; ``burst_s`` is the
    bucket times its :func:`refills` in the call).  Measured in the lab
    at 2 x 1, 1 Gb/s (a 196.6 us bucket): a 64 KiB ring takes 0.56-0.62 ms, its wire 0.52 ms, although
    its planning and latencies come to about 0.1 ms more."""
    if burst_s <= 0.0 or wire <= 0.0:
        return 0.0
    return max(0.0, min(total_s - wire, wire, burst_s))


def inflated(name: str) -> bool:
    """Whether oversubscription multiplies a parameter: CPU work (copies, reductions, TCP's own per-byte
    cost, the general path's per-call ``plan.alpha``) yes; latencies no (their wake-ups are parameters
    of their own), nor the shaped link's time per byte, ``link:<name>.beta`` (a byte on the wire takes as long whoever has the cores)."""
    if is_wire(name):
        return False
    return name == PLAN_ALPHA or parameter_kind(name) != "alpha"


def short_route(path: str, size: int, knobs: Knobs) -> bool:
    """Whether a single host tensor on ``path`` takes the engine's short route (as
    ``Engine._small_host_call`` decides): the agreed one-shot on one host, recursive doubling straight on
    the output between hosts."""
    return ((path == "oneshot" and size <= knobs.oneshot_max_bytes)
            or (path == "flat" and size <= knobs.doubling_max_bytes))


def _engine(path: str, topo: Topology, size: int, knobs: Knobs, route: str = "call") -> Coeffs:
    n, k = topo.hosts, topo.ranks_per_host
    c: Coeffs = {}
    short = route == "call" and short_route(path, size, knobs)
    if path != "alone":
        if not (short and path == "oneshot"):  # the one-host short route agrees inside its ordering point
            _add(c, "call.alpha", 1.0 if route == "call" else 0.0)
        if not short:
            _add(c, PLAN_ALPHA, 1.0)
    if path == "alone":
        _add(c, "shm.beta", size)
    elif path == "oneshot":
        _add(c, "shm.alpha", 1.0)
        _add(c, "shm.beta", size)
        _add(c, "gamma", k * size)
    elif path in ("twoshot", "hierarchical"):
        pieces = -(-size // max(1, knobs.segment_bytes))  # every term is linear in a piece's bytes
        _add(c, "shm.alpha", 2.0 * pieces if k > 1 else 0.0)
        _add(c, "shm.beta", 2.0 * size)
        _add(c, "gamma", size)
        if path == "hierarchical":
            link = f"link:{topo.link}"
            shard = min(size, knobs.segment_bytes) / k
            if shard <= knobs.doubling_max_bytes:  # each shard crosses by recursive doubling
                msgs, swaps, folds = _doubling_steps(n)
                _add(c, LINK_ALPHA, msgs * pieces)
                _add(c, f"{link}.beta", (swaps + folds) * size)  # K shards of a piece per host link
                _add(c, TCP_BETA, (swaps + folds) * size)
                _add(c, "gamma", 2.0 * (swaps + folds / 2) * size / k)
            else:
                _add(c, LINK_ALPHA, 2.0 * (n - 1) * pieces)
                _add(c, f"{link}.beta", 2.0 * (n - 1) / n * size)
                _add(c, TCP_BETA, 2.0 * (n - 1) / n * size)
                _add(c, "gamma", 2.0 * (n - 1) * size / (k * n))
    elif path == "flat" and size <= knobs.doubling_max_bytes:
        p, link = topo.ranks, f"link:{topo.link}"
        msgs, swaps, folds = _doubling_steps(p)
        crossing = _doubling_crossings(p, k)
        # the short route copies the input to the output once; the general path packs and unpacks
        _add(c, "shm.beta", (1.0 if short else 2.0) * size)
        _add(c, LINK_ALPHA, msgs)
        _add(c, f"{link}.beta", crossing * size)
        _add(c, TCP_BETA, crossing * size)
        _add(c, "gamma", (2.0 * swaps + folds) * size)
    elif path == "flat":
        p, link = topo.ranks, f"link:{topo.link}"
        chunk = size / p
        _add(c, "shm.beta", 2.0 * size)
        _add(c, LINK_ALPHA, (p - 1) * (math.ceil(chunk / knobs.segment_bytes) + 1))
        _add(c, f"{link}.beta", 2.0 * (p - 1) * chunk)
        _add(c, TCP_BETA, 2.0 * (p - 1) * chunk)
        _add(c, "gamma", 2.0 * (p - 1) * chunk)
    else:
        raise ValueError(f"unknown engine path {path!r}")
    return c


def _doubling_steps(ranks: int) -> tuple[float, float, float]:
    """Recursive doubling over ``ranks``: (messages on the critical path, swaps of the whole buffer,
    one-way transfers of it to fold in the ranks past the largest power of two and hand them the
    result: 0 or 2)."""
    swaps = ranks.bit_length() - 1
    folds = 2 if ranks > (1 << swaps) else 0
    return float(swaps + folds), float(swaps), float(folds)


@functools.lru_cache(maxsize=1024)
def _doubling_crossings(ranks: int, per_host: int) -> int:
    """Buffers through the busiest host's link in recursive doubling over ``ranks`` placed host by host
    (``per_host`` a host), summed over its steps: in each step, the most ranks of one host whose partner
    is on another host (they send at once, through the one link)."""
    high = 1 << (ranks.bit_length() - 1)
    host = [r // per_host for r in range(ranks)]

    def busiest(pairs: list[tuple[int, int]]) -> int:
        count: dict[int, int] = {}
        for a, b in pairs:
            if host[a] != host[b]:
                count[host[a]] = count.get(host[a], 0) + 1
        return max(count.values(), default=0)

    fold = busiest([(r, r - high) for r in range(high, ranks)])
    total = 2 * fold  # the extra ranks' buffers in, and the results back out
    mask = 1
    while mask < high:
        total += busiest([(r, r ^ mask) for r in range(high)])
        mask <<= 1
    return total


def _baseline(algorithm: str, name: str, topo: Topology, size: int) -> Coeffs:
    p, n = topo.ranks, topo.hosts
    if p == 1:
        return {f"{name}.beta": float(size)}
    c = {f"{name}.alpha": 2.0 * math.ceil(math.log2(p)), f"{name}.beta": 2.0 * (p - 1) / p * size}
    if topo.baselines_on_link and n > 1:
        # Its bytes between hosts also take the wire's time, the same wire the engine's rings use.  MPI's
        # recursive halving and doubling with ranks placed host by host (and MPICH's node-aware
        # composition alike) sends 2 (N-1)/N S through each host's link; gloo's ring over all ranks,
        # one hop out of each host per step, 2 (P-1)/P S.  Those bytes go through the kernel's TCP
        # stack as the engine's do, at the same CPU cost per byte.
        share = (n - 1) / n if algorithm == "mpi" else (p - 1) / p
        c[f"link:{topo.link}.beta"] = 2.0 * share * size
        c[TCP_BETA] = 2.0 * share * size
    return c


def _add(c: Coeffs, name: str, value: float) -> None:
    c[name] = c.get(name, 0.0) + float(value)


def parameter_kind(name: str) -> str:
    """``alpha``, ``beta`` or ``gamma``: the unit of a parameter (s, s/B, s/B; wake-ups,
    ``X.wake.alpha``, are s per unit of oversubscription; contention factors, ``<family>~over.beta``,
    have no unit)."""
    return name.rsplit(".", 1)[-1]
