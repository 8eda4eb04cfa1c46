"""bench tuner: landscapes replayed through the tuning driver (nearest grid point, recorded steps, drift),
the locked configuration scored, the CLI on a shipped landscape; and the grid helpers of bench landscape."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tunelab.bench.landscape import DEFAULT_GRID, grid_points, grid_space, parse_grid, visit_order
from tunelab.bench.tuner import (
    LANDSCAPE_DIR,
    Landscape,
    ceiling,
    evaluate,
    exhaustive_pick,
    plan_for,
    scoreboard,
    share_interval,
    truth_ceiling,
)
from tunelab.knobs import Knobs, MiB
from tunelab.tuning.plan import Plan
from tunelab.tuning.replay import Drift, Objective

pytest.importorskip("skopt")

NAMES = ["fusion_threshold_bytes", "cycle_time_ms"]
BASE = Knobs(cycle_time_ms=1.0)  # the default of these landscapes, as of those recorded before 2026-11-28


def landscape(points, names=NAMES, steps=False):
    """A handmade landscape: points are (knob changes, visit scores); with ``steps`` each visit also
    carries step times (samples_per_step 1: a step of 1/score seconds)."""
    doc = {"space": {"names": names, "base": BASE.as_dict()},
           "points": [{"knobs": BASE.replace(**k).as_dict(), "scores": s,
                       **({"steps_s": [[1.0 / x] for x in s]} if steps else {})} for k, s in points]}
    return Landscape.from_dict(doc, "tiny")


def tiny(steps=False):
    return landscape([({"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0}, [10.0, 12.0]),
                      ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 1.0}, [20.0, 20.0]),
                      ({"fusion_threshold_bytes": 0, "cycle_time_ms": 10.0}, [30.0, 34.0]),
                      ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 10.0}, [40.0, 44.0])], steps=steps)


@pytest.mark.parametrize("knobs,expected", [
    ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 1.0}, 20.0),    # on a grid point
    ({"fusion_threshold_bytes": 4 * MiB, "cycle_time_ms": 1.0}, 20.0),    # log2 22: nearer 23 than 13 (off)
    ({"fusion_threshold_bytes": 16 << 10, "cycle_time_ms": 10.0}, 32.0),  # log2 14: nearer the "off" bin
    ({"fusion_threshold_bytes": 0, "cycle_time_ms": 3.0}, 11.0),          # log 3 is nearer log 1 than log 10
    ({"fusion_threshold_bytes": 0, "cycle_time_ms": 4.0}, 32.0),          # log 4 is nearer log 10
    ({"fusion_threshold_bytes": 64 * MiB, "cycle_time_ms": 100.0}, 42.0),
])
def test_landscape_answers_the_nearest_grid_point(knobs, expected):
    land = tiny()
    assert land.true_score(Knobs().replace(**knobs)) == expected and land.best == 42.0


def test_recorded_step_times_are_replayed_and_drift_scales_them():
    land = tiny(steps=True)
    knobs = Knobs(fusion_threshold_bytes=0, cycle_time_ms=10.0)
    assert land.true_score(knobs) == pytest.approx(32.0)  # the mean rate of the recorded steps
    draws = {Objective(land, seed=s).step_s(knobs) for s in range(20)}
    assert draws == {1 / 30.0, 1 / 34.0}  # only recorded steps come back
    drift = Drift(0.1, 60.0, seed=2)
    assert max(abs(math.log(drift.factor(t))) for t in range(120)) <= 0.1 + 1e-12
    slowed = Objective(land, seed=0, drift=drift)
    plain = Objective(land, seed=0)
    for _ in range(5):
        a, b = slowed.step_s(knobs), plain.step_s(knobs)
        assert a == pytest.approx(b * drift.factor(slowed.t_s - a))


def test_old_files_without_step_times_replay_log_normal_noise_of_the_pooled_spread():
    land = tiny()
    knobs = Knobs(fusion_threshold_bytes=8 * MiB, cycle_time_ms=1.0)
    rates = [1.0 / Objective(land, seed=s).step_s(knobs) for s in range(200)]
    assert land.sigma > 0 and abs(np.median(rates) / 20.0 - 1) < 0.05 and np.std(np.log(rates)) > 0.01


@pytest.mark.parametrize("visits", [2, 3, 6])
def test_an_old_files_block_spread_is_the_pooled_sd_whatever_the_visits_per_point(visits):
    """960 points of planted block scores at a log sd of 5 %: the pooled estimate (n - 1 degrees of
    freedom per point) finds 5 %.  Doubling the mean squared deviation was right for 2 visits only: 3
    gave 5.7 %, 6 gave 6.4 %."""
    from tunelab.tuning.replay import STEP_SPREAD_OF_BLOCK

    rng = np.random.default_rng(3)
    points = [({"fusion_threshold_bytes": (i % 40) * MiB, "cycle_time_ms": 1.0 + i // 40},
               list(np.exp(rng.normal(3.0, 0.05, visits)))) for i in range(960)]
    land = landscape(points)
    assert land.sigma / STEP_SPREAD_OF_BLOCK == pytest.approx(0.05, rel=0.06)  # (3 sd of the estimate at 2 visits)


def test_a_landscape_with_two_points_of_the_same_knobs_is_refused():
    """The replay answers the first of them; the truth might be the other's, a point no run can lock."""
    from tunelab.errors import TunelabError

    with pytest.raises(TunelabError, match="landscape tiny: points 1 and 2 have the same knobs"):
        landscape([({"fusion_threshold_bytes": 0}, [10.0]), ({"fusion_threshold_bytes": MiB}, [20.0]),
                   ({"fusion_threshold_bytes": MiB}, [30.0])])


def _visit_recording(visit_noise, seed=11):
    """12 points of 1 step/s at 2 % step noise, 8 visits of 3 steps each (after one discarded step),
    every visit's steps moved together by a host state of sd ``visit_noise``."""
    from tunelab.tuning.replay import synthetic
    from tunelab.tuning.space import SearchSpace

    space = SearchSpace(("fusion_threshold_bytes",), Knobs())
    grid = {"fusion_threshold_bytes": [(i + 1) * MiB for i in range(12)]}
    return synthetic("visits", space, grid, lambda k: 1.0, noise=0.02, seed=seed, visits=8, visit_noise=visit_noise)


def _replayed_blocks(land, blocks=600, steps=3, visit_noise=True):
    """Mean log rate of ``blocks`` blocks of one point, each after a block of another point (a knob
    change, as a tuning run's candidates and references alternate): one discarded step, then ``steps``
    measured ones, as the driver measures them; no drift."""
    obj = Objective(land, seed=4, visit_noise=visit_noise)
    one, other = land.knobs[0], land.knobs[1]
    means = []
    for _ in range(blocks):
        for _ in range(1 + steps):
            obj.step_s(other)
        obj.step_s(one)  # discarded
        means.append(np.mean([-math.log(obj.step_s(one)) for _ in range(steps)]))
    return np.asarray(means)


def test_visits_that_differ_beyond_their_steps_are_replayed_a_visit_at_a_time():
    """Planted: 2 % step noise and a 4 % host state per visit.  The recording's analysis finds the 4 %,
    and a replayed block of 3 measured steps varies as a draw of one recorded visit and three of its steps
    does (from the point's recorded visits: the variance of their means plus their own spread over 3),
    where steps drawn one by one from the pool of every visit would average the state away (the pool's
    variance over 3); 12-step blocks span several visits.  Without a planted state, or with
    ``visit_noise=False``, steps come from the pool."""
    land = _visit_recording(0.04)
    assert 0.03 < land.visit_sigma < 0.05 and land.recorded["visit_noise"]["p_value"] < 0.01
    assert land.visit_seconds == pytest.approx(4.0, rel=0.05)  # 1 discarded + 3 measured steps of about 1 s
    visits = [np.log(1.0 / v) for v in land.visit_pools[0]]
    assert len(visits) == 8 and all(v.size == 3 for v in visits)
    one_visit = float(np.var([v.mean() for v in visits]) + np.mean([np.var(v) for v in visits]) / 3)
    pooled = float(np.var(np.log(land.step_pools[0]))) / 3
    assert one_visit > 2 * pooled
    assert float(np.var(_replayed_blocks(land))) == pytest.approx(one_visit, rel=0.2)
    assert float(np.var(_replayed_blocks(land, blocks=300, steps=12))) < 0.5 * one_visit
    assert float(np.var(_replayed_blocks(land, visit_noise=False))) == pytest.approx(pooled, rel=0.2)
    recorded = {float(x) for p in land.visit_pools for v in p for x in v}
    obj = Objective(land, seed=1)
    assert all(obj.step_s(land.knobs[i % 3]) in recorded for i in range(200))  # nothing replayed unrecorded
    steady = _visit_recording(0.0)
    assert steady.visit_sigma == 0.0 and steady.visit_pools is None and "visit_noise" not in steady.recorded
    pooled = float(np.var(np.log(steady.step_pools[0]))) / 3
    assert float(np.var(_replayed_blocks(steady))) == pytest.approx(pooled, rel=0.2)


def _two_hosts_landscape():
    """Two points of 1 step/s recorded in 8 visits of 3 steps: the first quiet (every visit at the same
    state, 1 % steps), the second with visits at +-10 % (3 % steps)."""
    from tunelab.tuning.replay import Landscape

    rng = np.random.default_rng(5)
    base = Knobs()
    points = []
    for fusion, states, step in ((MiB, [0.0] * 8, 0.01), (2 * MiB, [0.1, -0.1] * 4, 0.03)):
        steps = [[float(math.exp(-s + rng.normal(0.0, step))) for _ in range(3)] for s in states]
        points.append({"knobs": base.replace(fusion_threshold_bytes=fusion).as_dict(), "steps_s": steps,
                       "scores": [1.0 / float(np.median(v)) for v in steps]})
    doc = {"space": {"names": ["fusion_threshold_bytes"], "base": base.as_dict()}, "points": points,
           "samples_per_step": 1.0, "discard_steps": 1}
    return Landscape.from_dict(doc, "two-hosts")


def test_a_slow_visit_holds_as_long_as_it_took_so_a_point_replays_at_its_recorded_mean():
    """A point recorded in visits at host states of +-30 % (each 3 steps, 2 % step noise): replayed in
    blocks of 12 or 100 steps after another point's, its mean log rate is its recorded steps' (within the
    draws' own noise, 0.015 here).  Each drawn state once held for the mean visit's time: the slow
    visits were cut short and the fast ones ran whole, and the point replayed 7 % fast."""
    rng = np.random.default_rng(5)
    base = Knobs()
    points = []
    for fusion, states in ((MiB, [0.0] * 8), (2 * MiB, [0.3, -0.3] * 4)):
        steps = [[float(math.exp(-s + rng.normal(0.0, 0.02))) for _ in range(3)] for s in states]
        points.append({"knobs": base.replace(fusion_threshold_bytes=fusion).as_dict(), "steps_s": steps,
                       "scores": [1.0 / float(np.median(v)) for v in steps]})
    from tunelab.tuning.replay import Landscape

    land = Landscape.from_dict({"space": {"names": ["fusion_threshold_bytes"], "base": base.as_dict()},
                                "points": points, "samples_per_step": 1.0, "discard_steps": 1}, "slow-visits")
    assert land.visit_pools is not None  # (the states are replayed a visit at a time)
    one, other = land.knobs[1], land.knobs[0]
    for steps in (12, 100):
        obj = Objective(land, seed=4)
        logs = []
        for _ in range(400):
            for _ in range(4):
                obj.step_s(other)
            obj.step_s(one)  # discarded
            logs += [-math.log(obj.step_s(one)) for _ in range(steps)]
        assert abs(float(np.mean(logs)) - land.true_log_rate(one)) < 0.03, steps


def test_a_pooled_host_state_gives_every_point_the_same_state_and_keeps_its_own_steps():
    """``visit_noise="pooled"``: a point's block is one of its own visits moved to the state of a visit
    drawn from every point's.  The quiet point, replayed as recorded, has no state between blocks; pooled,
    its blocks vary as much as the noisy point's (the pool of both points' states, variance 0.005), while
    each block's steps keep their own point's spread (1 % and 3 %) and the point's mean log rate stays."""
    land = _two_hosts_landscape()
    assert land.visit_pools is not None
    own, states = land.visit_states
    assert float(np.max(np.abs(own[0]))) < 0.02 and float(np.min(np.abs(own[1]))) > 0.05  # as planted
    assert float(np.var(states)) == pytest.approx(0.005, rel=0.3)
    quiet, noisy = land.knobs
    flipped = Landscape(land.name, land.space, [noisy, quiet], land.step_pools[::-1], land.means[::-1], 0.0,
                        recorded=land.recorded, visit_sigma=land.visit_sigma, visit_seconds=land.visit_seconds,
                        visit_pools=land.visit_pools[::-1])
    recorded_quiet = _replayed_blocks(land, blocks=800)
    pooled_quiet = _replayed_blocks(land, blocks=800, visit_noise="pooled")
    pooled_noisy = _replayed_blocks(flipped, blocks=800, visit_noise="pooled")
    assert float(np.var(recorded_quiet)) < 0.0005
    assert float(np.var(pooled_quiet)) == pytest.approx(float(np.var(states)) + 0.01 ** 2 / 3, rel=0.25)
    assert float(np.var(pooled_noisy)) == pytest.approx(float(np.var(states)) + 0.03 ** 2 / 3, rel=0.25)
    assert float(np.mean(pooled_quiet)) == pytest.approx(land.true_log_rate(quiet), abs=0.01)
    obj = Objective(land, seed=2, visit_noise="pooled")
    for i, knobs in enumerate((quiet, noisy)):  # within a visit: the point's own steps, moved by one state
        within = []
        for _ in range(400):
            obj.step_s(noisy if knobs == quiet else quiet)
            within.append(float(np.var([-math.log(obj.step_s(knobs)) for _ in range(3)], ddof=1)))
        # three draws (with replacement) from one recorded visit's three steps: their variance about their mean
        recorded = float(np.mean([np.var(np.log(1.0 / v)) for v in land.visit_pools[i]]))
        assert float(np.mean(within)) == pytest.approx(recorded, rel=0.3)
    with pytest.raises(ValueError, match="visit_noise"):
        Objective(land, seed=0, visit_noise="sometimes")


def test_the_yardstick_draws_a_pooled_host_state_as_the_replay_does():
    """Every point measured once: pooled, the quiet point's blocks vary by the pool of every point's
    states (as the replay's do); as recorded, by its own steps only."""
    from tunelab.bench.tuner import exhaustive_blocks, exhaustive_pick

    land = _two_hosts_landscape()
    _, states = land.visit_states
    recorded = exhaustive_blocks(land, 3, draws=4000, visit_noise="recorded")
    pooled = exhaustive_blocks(land, 3, draws=4000, visit_noise="pooled")
    assert float(np.var(recorded[:, 0])) < 0.0005 and float(np.var(recorded[:, 1])) > 0.008
    for i, step in enumerate((0.01, 0.03)):  # both points: the pool's states, their own steps, their own mean
        assert float(np.var(pooled[:, i])) == pytest.approx(float(np.var(states)) + step ** 2 / 3, rel=0.2)
        assert float(np.mean(pooled[:, i])) == pytest.approx(land.true_log_rate(land.knobs[i]), abs=0.005)
    assert 0.0 <= exhaustive_pick(land, 3, visit_noise="pooled") <= 1.0


def test_categorical_knobs_must_match_exactly():
    names = [*NAMES, "hierarchical"]
    land = landscape([({"fusion_threshold_bytes": 8 * MiB, "hierarchical": False}, [5.0]),
                      ({"fusion_threshold_bytes": 0, "hierarchical": True}, [7.0])], names)
    near_false = Knobs(fusion_threshold_bytes=8 * MiB, hierarchical=True)
    assert land.true_score(near_false) == 7.0
    assert land.true_score(near_false.replace(hierarchical=False)) == 5.0


def test_evaluate_scores_the_locked_configuration():
    land = tiny(steps=True)
    row, curves = evaluate(land, "tunelab", seeds=3, plan=Plan(), drift=0.05)
    assert row["seeds"] == 3 and 0.0 <= row["locked_within_3pct_frac"] <= 1.0
    default = land.true_score(land.space.base)
    for curve in curves:  # the default until the lock, then the locked configuration's true score
        assert curve[0] == pytest.approx(default / land.best) and len(curve) >= 3
        assert any(curve[-1] * land.best == pytest.approx(m) for m in land.means)


def _wilson(k: int, n: int, z: float = 1.6448536269514722) -> tuple[float, float]:
    """The Wilson score interval written out (z: the 95th percentile of the normal, a 90 % interval)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(16, 20), (0, 20), (20, 20), (3, 7)])
def test_a_fraction_over_seeds_comes_with_its_wilson_interval(k, n):
    low, high = share_interval([True] * k + [False] * (n - k))
    assert (low, high) == pytest.approx(_wilson(k, n), abs=1e-9)
    assert low <= k / n <= high and (k < n or high == pytest.approx(1.0)) and (k > 0 or low == pytest.approx(0.0))


def test_evaluate_gives_each_fraction_its_interval():
    land = tiny(steps=True)
    row, _ = evaluate(land, "tunelab", seeds=4, plan=Plan(), drift=0.05)
    for name in ("locked_within_3pct", "locked_worse_than_default"):
        k = round(row[f"{name}_frac"] * 4)
        assert row[f"{name}_interval"] == pytest.approx(list(_wilson(k, 4)), abs=1e-9)


def test_evaluate_says_how_often_a_locked_gain_reached_its_claimed_low_end():
    """Without noise or drift every interval is around the true gain: its low end always holds; the
    fraction counts locked runs only (a flat landscape locks nothing: n/a)."""
    exact = landscape([({"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0}, [10.0, 10.0]),
                       ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 10.0}, [14.0, 14.0]),
                       ({"fusion_threshold_bytes": 64 * MiB, "cycle_time_ms": 1.0}, [10.0, 10.0])], steps=True)
    row, _ = evaluate(exact, "tunelab", seeds=3, plan=Plan(), drift=0.0)
    assert row["adopted_frac"] == 1.0 and row["locked_low_end_held_frac"] == 1.0
    flat = landscape([({"fusion_threshold_bytes": f}, [10.0, 10.0]) for f in (0, 8 * MiB, 64 * MiB)], steps=True)
    row, _ = evaluate(flat, "tunelab", seeds=2, plan=Plan(), drift=0.0)
    assert row["adopted_frac"] == 0.0 and row["locked_low_end_held_frac"] is None


def test_the_exhaustive_yardstick_is_the_chance_that_one_block_each_ranks_the_best_first():
    """Point B (steps at 2 and 0.5 samples/s: mean 1.25, the best) against A (always 1.0): with one-step
    blocks B measures above A half the time; with two-step blocks it ties or wins 3 times in 4 (ties go
    to the first point, B)."""
    land = landscape([({"fusion_threshold_bytes": 8 * MiB}, [2.0, 0.5]), ({"fusion_threshold_bytes": 0}, [1.0, 1.0])],
                     steps=True)
    assert land.best == pytest.approx(1.25)
    assert exhaustive_pick(land, 1, draws=4000) == pytest.approx(0.5, abs=0.04)
    assert exhaustive_pick(land, 2, draws=4000) == pytest.approx(0.75, abs=0.04)
    clear = landscape([({"fusion_threshold_bytes": 8 * MiB}, [2.0, 2.0]), ({"fusion_threshold_bytes": 0}, [1.0, 1.0])],
                      steps=True)
    assert exhaustive_pick(clear, 1) == 1.0


def test_the_truth_ceiling_is_how_often_the_recorded_best_stays_within_3_percent_of_a_resample():
    """A: two visits at 1.05 (the recorded best); B: visits at 0.96 and 1.10 (mean 1.03).  Resampling
    B's two visits gives 0.96, 1.03 or 1.10 (1/4, 1/2, 1/4); only at 1.10 is A (1.05) more than 3 %
    behind (1.05 < 0.97 x 1.10).  So 0.75.  Well-separated points: 1.0; one visit a point: not known."""
    land = landscape([({"fusion_threshold_bytes": 8 * MiB}, [1.05, 1.05]),
                      ({"fusion_threshold_bytes": 0}, [0.96, 1.10])], steps=True)
    assert truth_ceiling(land, draws=4000) == pytest.approx(0.75, abs=0.03)
    assert truth_ceiling(tiny(steps=True)) == 1.0
    assert truth_ceiling(tiny()) == 1.0  # old files: each visit's score
    assert truth_ceiling(landscape([({"fusion_threshold_bytes": 0}, [1.0]), ({}, [2.0])], steps=True)) is None


def drifting_recording(drift, points=12, visits=6, steps=3, noise=0.02, seed=3, order=True):
    """A recorded landscape with a known truth: point i runs at 1 + 0.02 i steps/s, each step with
    log-normal ``noise``, and the host slowed by ``drift`` (a log factor) as a function of the visit's
    position in the shuffled visiting order, as ``bench landscape`` records it."""
    rng = np.random.default_rng(seed)
    sequence = visit_order(points, visits, seed)
    truth = np.asarray([1.0 + 0.02 * i for i in range(points)])
    steps_s: list[list[list[float]]] = [[] for _ in range(points)]
    for t, i in enumerate(sequence):
        slow = drift(t / len(sequence))
        steps_s[i].append([float(math.exp(slow + rng.normal(0.0, noise)) / truth[i]) for _ in range(steps)])
    doc = {"space": {"names": NAMES, "base": Knobs().as_dict()},
           "points": [{"knobs": Knobs(fusion_threshold_bytes=(i + 1) * MiB).as_dict(),
                       "scores": [1.0 / float(np.median(v)) for v in s], "steps_s": s}
                      for i, s in enumerate(steps_s)],
           **({"order": sequence} if order else {})}
    return doc, truth


def _pool_noise(land):
    """Pooled sd of the log step rates around each point's own mean."""
    return float(np.sqrt(np.mean(np.concatenate([(np.log(1.0 / p) - np.log(1.0 / p).mean()) ** 2
                                                 for p in land.step_pools]))))


def test_a_recordings_own_host_drift_is_taken_out_of_the_replayed_steps():
    """A host 16 % slower in the middle of the recording: replayed as it was recorded, every pool would
    carry that drift as step noise, and its visits differ by it (the replay adds its own drift on top);
    taken out along the visiting order, the pools come back to the planted 2 % step noise, next to
    nothing is left between visits, and the points' means come nearer the truth."""
    def slow(x):
        return 0.16 * math.sin(math.pi * x)

    def mean_error(land):
        return np.max(np.abs(np.log(land.means / land.means.mean()) - np.log(truth / truth.mean())))

    doc, truth = drifting_recording(slow)
    raw = Landscape.from_dict(drifting_recording(slow, order=False)[0], "raw")
    fixed = Landscape.from_dict(doc, "fixed")
    assert "drift_removed" not in (raw.recorded or {})
    removed = fixed.recorded["drift_removed"]
    assert removed["lag1"] > 0.5 and 0.03 < removed["sigma"] < 0.08
    assert _pool_noise(raw) > 0.045 and _pool_noise(fixed) < 0.03
    assert raw.visit_sigma > 0.045 and fixed.visit_sigma < 0.015
    assert mean_error(fixed) < 0.8 * mean_error(raw)


def test_a_recording_without_drift_or_whose_order_does_not_match_is_replayed_as_recorded():
    steady, _ = drifting_recording(lambda x: 0.0)
    land = Landscape.from_dict(steady, "steady")
    assert "drift_removed" not in land.recorded
    flat = [t for p in steady["points"] for v in p["steps_s"] for t in v]
    assert np.array_equal(np.concatenate(land.step_pools), np.asarray(flat))
    drifting, _ = drifting_recording(lambda x: 0.16 * math.sin(math.pi * x))
    for bad in (drifting["order"][:-1], [*drifting["order"][:-1], 99], "1,2,3"):
        assert "drift_removed" not in Landscape.from_dict({**drifting, "order": bad}, "bad").recorded


def test_a_drift_no_larger_than_its_own_estimates_noise_is_shrunk_to_almost_nothing():
    """Two shipped recordings whose visits are autocorrelated beyond chance: the ResNet-50 one drifted by
    4 % while it recorded; the vgg16-2nodes one by about as much as a median of its neighbours varies
    by chance, so next to nothing is taken out of it."""
    small = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json").recorded["drift_removed"]
    large = Landscape.load(LANDSCAPE_DIR / "resnet50-torch-2ranks-12visits.json").recorded["drift_removed"]
    assert small["lag1"] > 2 / math.sqrt(72) and small["sigma"] < 0.002
    assert large["lag1"] > 0.5 and large["sigma"] > 0.03


def test_the_true_gain_is_a_ratio_of_geometric_means_as_blocks_score():
    land = landscape([({"fusion_threshold_bytes": 8 * MiB}, [2.0, 0.5]), ({"fusion_threshold_bytes": 0}, [1.0, 1.0])],
                     steps=True)
    fast = Knobs().replace(fusion_threshold_bytes=8 * MiB)
    assert land.true_score(fast) == pytest.approx(1.25)  # the mean rate
    assert land.true_log_rate(fast) == pytest.approx(0.0)  # the mean log rate: no gain over the other point


def test_grid_helpers():
    grid = parse_grid(DEFAULT_GRID)
    assert grid == {"fusion_threshold_bytes": [0, MiB, 8 * MiB, 64 * MiB], "cycle_time_ms": [0.5, 2.0, 8.0, 32.0],
                    "segment_bytes": [256 << 10, 4 * MiB]}
    assert len(grid_points(grid, Knobs())) == 32
    order = visit_order(32, 2, seed=4)
    assert sorted(order[:32]) == sorted(order[32:]) == list(range(32)) and order[:32] != order[32:]
    assert parse_grid(["hier=on,off"]) == {"hierarchical": [True, False]}
    for bad in (["speed=1,2"], ["cycle=0"], ["fusion=1MiB", "fusion=2MiB"]):
        with pytest.raises(ValueError):
            parse_grid(bad)
    with pytest.raises(ValueError, match="hierarchical"):
        grid_space({"hierarchical": [False, True]}, {}, num_nodes=1)
    with pytest.raises(ValueError, match="pinned"):
        grid_space({"cycle_time_ms": [1.0]}, {"cycle_time_ms": 2.0}, num_nodes=1)
    assert grid_space(grid, {}, num_nodes=2).names == ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes")
    # the device path's one-shot size is searched for GPU jobs, and so may be recorded for them only
    assert grid_space({"oneshot_max_bytes": [0, 1 << 20]}, {}, num_nodes=1, device=True).names == ("oneshot_max_bytes",)
    with pytest.raises(ValueError, match="GPU jobs only"):
        grid_space({"oneshot_max_bytes": [0, 1 << 20]}, {}, num_nodes=1)


def test_cli_on_a_shipped_landscape(tmp_path):
    shipped = LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json"
    out = tmp_path / "tuner.json"
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--landscape", str(shipped),
                           "--seeds", "2", "--strategies", "tunelab,random,horovod,coordinate", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reports = list((tmp_path / "reports").glob("tuner-*.html"))  # a bench writes its report by default
    assert len(reports) == 1 and f"# report: reports/{reports[0].name}" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["strategy"] for r in result["rows"]] == ["tunelab", "random", "horovod", "coordinate"]
    for row in result["rows"]:
        assert {"strategy", "landscape", "median_samples_to_lock", "locked_within_3pct_frac",
                "locked_worse_than_default_frac"} <= set(row)
        assert row["seeds"] == 2 and row["landscape"] == "replay-vgg16-2nodes-10gbps"
        assert row["median_samples_to_lock"] >= 3
    for curve in result["curves"].values():
        assert all(0 < v <= 1.0 + 1e-9 for v in curve)  # fractions of the landscape's best
    assert "within3%" in proc.stdout
    board = result["scoreboard"]  # (its counts against hand-counted rows: test_scoreboard_counts_...)
    assert set(board["targets"]) == {"tunelab", "random", "horovod", "coordinate"}
    assert all(t["landscapes"] == 1 for t in board["targets"].values())
    assert "# targets met, of 1 landscape:" in proc.stdout and "# within 3 %, tunelab vs random: " in proc.stdout
    assert board["ceiling"]["landscapes"] == 1 and "#   for scale, every point measured once" in proc.stdout
    # the plan each landscape ran with (its own block steps and budget), not only the defaults
    from tunelab.bench.tuner import plan_for
    from tunelab.tuning.replay import Landscape

    ran = result["landscapes"]["replay-vgg16-2nodes-10gbps"]["plan"]
    assert ran == json.loads(json.dumps(vars(plan_for(Landscape.load(shipped)))))


def _row(strategy, landscape, samples, within, worse):
    return {"strategy": strategy, "landscape": landscape, "median_samples_to_lock": samples,
            "locked_within_3pct_frac": within, "locked_worse_than_default_frac": worse}


def test_scoreboard_counts_targets_met_and_head_to_head_shares():
    """Counted by hand: a target met exactly (12 samples, 0.90, 0.05) counts; a landscape one strategy
    did not run counts for none."""
    rows = [_row("tunelab", "a", 12, 0.90, 0.05), _row("random", "a", 20, 0.95, 0.00),
            _row("tunelab", "b", 13, 0.85, 0.10), _row("random", "b", 11, 0.85, 0.00),
            _row("tunelab", "c", 9, 1.00, 0.00), _row("random", "c", 25, 0.60, 0.06),
            _row("tunelab", "only-one", 1, 1.00, 0.00)]
    board = scoreboard(rows)
    assert board["targets"] == {
        "tunelab": {"landscapes": 3, "samples_to_lock": 2, "within_3pct": 2, "worse_than_default": 2},
        "random": {"landscapes": 3, "samples_to_lock": 1, "within_3pct": 1, "worse_than_default": 2}}
    assert board["within_3pct_versus"] == {"tunelab vs random": {"ahead": 1, "level": 1, "behind": 1},
                                           "random vs tunelab": {"ahead": 1, "level": 1, "behind": 1}}


def test_ceiling_counts_landscapes_an_exhaustive_search_and_the_recording_itself_know_to_3_pct():
    """Counted by hand: 0.90 counts, 0.89 does not; a landscape without a truth ceiling (one visit a point)
    is left out of that count; the blocks are the median grid size."""
    info = {"a": {"exhaustive_within_3pct": 0.90, "truth_ceiling_within_3pct": 0.95, "points": 24},
            "b": {"exhaustive_within_3pct": 0.89, "truth_ceiling_within_3pct": 0.75, "points": 18},
            "c": {"exhaustive_within_3pct": 1.00, "truth_ceiling_within_3pct": None, "points": 30}}
    assert ceiling(info) == {"landscapes": 3, "exhaustive_within_3pct": 2, "exhaustive_blocks": 24,
                             "recording_knows_best": 1, "recording_known": 2}


def test_bad_cli_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    doc = json.loads((LANDSCAPE_DIR / "replay-bert-2ranks.json").read_text())
    (tmp_path / "zero.json").write_text(json.dumps({**doc, "samples_per_step": 0}))
    doc["points"][0]["steps_s"][0][0] = 0.0
    (tmp_path / "zero-step.json").write_text(json.dumps(doc))
    cases = [(["--landscape", str(bad)], "not a landscape file"), (["--drift", "2"], "fraction"),
             (["--landscape", str(tmp_path / "binary.json")], "is not a landscape JSON file"),
             (["--landscape", str(tmp_path / "zero.json")], "samples_per_step must be a number in (0, 1e6]"),
             (["--landscape", str(tmp_path / "zero-step.json")], "samples_per_step must be a positive number and every step time one from"),
             (["--landscape", "no-such-landscape"], "No such file"),
             (["--hosts", "4", "--model-noise", "0.1"], "--hosts, --model-noise describe the scale model's objective")]
    for args, fragment in cases:
        proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", *args, "--no-report"],
                              check=False, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and fragment in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_shipped_landscape_is_named_by_its_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--landscape", "replay-bert-2ranks",
                           "--seeds", "1", "--strategies", "random", "--no-report"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "# replay-bert-2ranks: 24 points" in proc.stdout


def test_a_landscape_whose_scenario_is_unknown_here_says_which_budget_it_replays_with(tmp_path):
    from tunelab.bench.tuner import LANDSCAPE_DIR, plan_for
    from tunelab.tuning.plan import Plan
    from tunelab.tuning.replay import Landscape

    doc = json.loads((LANDSCAPE_DIR / "replay-bert-2ranks.json").read_text())
    assert plan_for(Landscape.from_dict(doc, "known")).budget_samples == 20  # replay-bert's own budget
    doc["scenario"] = "recorded-elsewhere"
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(doc))
    assert plan_for(Landscape.from_dict(doc, "elsewhere")).budget_samples == Plan().budget_samples
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--landscape", str(path),
                           "--seeds", "1", "--strategies", "random", "--no-report"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (f"#   its scenario 'recorded-elsewhere' cannot be loaded here: the default budget of "
            f"{Plan().budget_samples} blocks is used") in proc.stdout


def test_the_shipped_two_node_landscape_searches_hierarchical_jointly():
    land = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json")
    assert land.space.names == ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes", "hierarchical")
    assert len(land.knobs) == 24 and all(p.size == 9 for p in land.step_pools)  # 3 visits x 3 steps
    assert land.knobs[int(land.means.argmax())].hierarchical  # behind a slow link the node-local stages pay


@pytest.mark.mpi
def test_bench_landscape_visits_last_a_tuning_block_where_steps_are_fast(tmp_path):
    """A visit is measured as a tuning block is: on a workload whose steps take ~35 ms, block_seconds
    (here 0.5) sets the visit's steps, recorded as the landscape's measure_steps, which its replay's plan
    then uses."""
    (tmp_path / "fast.toml").write_text(
        'workload = "replay"\nmodel = "resnet50"\n[run]\nnp = 2\n[tuning]\nmeasure_steps = 3\nblock_seconds = 0.5\n'
        '[replay]\nforward_ms = 10\nbackward_ms = 20\n')
    out = tmp_path / "fast.json"
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "landscape", "--scenario",
                           str(tmp_path / "fast.toml"), "--grid", "fusion_threshold_bytes=0,64MiB", "--repeats", "1",
                           "--json", str(out), "--no-report"], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    n = doc["measure_steps"]
    assert n > 3 and doc["block_seconds"] == 0.5
    visits = [v for p in doc["points"] for v in p["steps_s"]]
    assert all(len(v) == n for v in visits) and sum(map(sum, visits)) / len(visits) > 0.4
    plan = plan_for(Landscape.from_dict(doc, "fast"))
    assert plan.measure_steps == n and plan.block_seconds == 0.5


@pytest.mark.mpi
def test_bench_landscape_inside_the_users_mpiexec_records_hierarchical_on_the_jobs_nodes(tmp_path):
    """Inside the user's own mpiexec the job is the world's 4 ranks, 2 emulated nodes of 2: hierarchical
    is searched there.  The command's own check before a launch, which counted the scenario's ranks
    (one node), once refused the grid on every rank."""
    from tunelab.launch import mpiexec_command

    (tmp_path / "tiny.toml").write_text(
        'workload = "replay"\nmodel = "resnet50"\n[run]\nnp = 2\n[tuning]\nwarmup_steps = 1\nmeasure_steps = 2\n'
        'block_seconds = 0.2\n[replay]\nforward_ms = 10\nbackward_ms = 20\n')
    out = tmp_path / "in-job.json"
    proc = subprocess.run([*mpiexec_command(), "-n", "4", sys.executable, "-m", "tunelab.cli", "bench", "landscape",
                           "--scenario", str(tmp_path / "tiny.toml"), "--ranks-per-node", "2", "--grid",
                           "hier=true,false", "--repeats", "1", "--json", str(out), "--no-report"],
                          capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert sorted(p["knobs"]["hierarchical"] for p in doc["points"]) == [False, True]


@pytest.mark.mpi
def test_bench_landscape_trains_the_batch_and_images_it_is_given(tmp_path):
    """--batch-size and --image-size override the training scenario's, as for tune: the landscape's
    samples a step are the ranks times the batch asked for (the scenario's own batch is 8)."""
    out = tmp_path / "small.json"
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "landscape", "--model", "resnet50",
                           "--batch-size", "3", "--image-size", "32", "--grid", "cycle_time_ms=1,8", "--repeats", "1",
                           "--json", str(out), "--no-report"], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["samples_per_step"] == 6
    assert doc["hardware"].get("gpu_count") is None  # a CPU job records no GPU facts
    assert doc["device"] == "cpu" and doc["link_gbps"] is None and "lab" not in doc["hardware"]  # where it ran


def _model_with_a_fast_path(tmp_path):
    """A hand-written scale model (fitted on nothing here): a 1 Gb/s link, speeds derived from it, and no
    wake-ups where ranks outnumber cores."""
    from tunelab.model.fit import ScaleModel

    path = tmp_path / "model.json"
    ScaleModel({"call.alpha": 0.0, "plan.alpha": 0.0, "shm.alpha": 1e-5, "shm.beta": 1e-10, "gamma": 1e-10,
                "link.alpha": 1e-4, "link:1gbps.beta": 8e-9, "mpi.alpha": 1e-5, "mpi.beta": 1e-9, "mpi.gamma": 0.0,
                "call.wake.alpha": 0.0, "link.wake.alpha": 0.0, "shm.wake.alpha": 0.0}).save(path)
    return path


def test_the_models_first_proposals_for_a_landscape_are_its_best_grid_points_on_the_recorded_layout(tmp_path):
    """vgg16-2nodes was recorded on 2 emulated nodes of 2 ranks (4 ranks on 2 cores) behind its
    scenario's 10 Gb/s link: the proposals are the two grid points the model predicts fastest there,
    every point of the recording tried one by one; a landscape trained on GPUs gets none."""
    from tunelab.model.costs import Topology
    from tunelab.model.fit import ScaleModel
    from tunelab.model.step import Workload, simulate_step
    from tunelab.model.tuner import landscape_proposals

    path = _model_with_a_fast_path(tmp_path)
    land = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json")
    first, lines = landscape_proposals(path, land)
    assert "(2 hosts x 2 ranks, link 10gbps;" in lines[1]
    model = ScaleModel.load(path).with_link("10gbps", 10.0)
    work = Workload.of_model("replay-vgg16-2nodes", "vgg16", 100.0, 200.0)
    topo = Topology(2, 2, "10gbps", 4 / 2)
    by_time = sorted(land.knobs, key=lambda k: simulate_step(model, work, topo, k).step_s)
    assert first == by_time[:2] and all(k in land.knobs for k in first)
    gpu = Landscape.load(LANDSCAPE_DIR / "vgg16-torch-2ranks-h100.json")
    none, why = landscape_proposals(path, gpu)
    assert none == [] and len(why) == 1 and "trained on GPUs" in why[0]
    doc = json.loads((LANDSCAPE_DIR / "replay-resnet50-lab-3visits.json").read_text())
    assert landscape_proposals(path, Landscape.from_dict(doc, "lab"))[0]  # as recorded: 2 lab hosts of 2 ranks
    for broken in ("garbage", {"hosts": "two", "ranks_per_host": 2}, {"hosts": 0, "ranks_per_host": 2}):
        odd = Landscape.from_dict({**doc, "hardware": {**doc["hardware"], "lab": broken}}, "odd")
        none, why = landscape_proposals(path, odd)  # a damaged record: said in a line, not a traceback
        assert none == [] and len(why) == 1 and "does not record" in why[0]


def test_bench_tuner_runs_each_strategy_again_from_the_models_first_proposals(tmp_path):
    from tunelab.bench.tuner import run_once
    from tunelab.model.tuner import landscape_proposals

    path = _model_with_a_fast_path(tmp_path)
    out = tmp_path / "tuner.json"
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--landscape",
                           "replay-vgg16-2nodes-10gbps", "--landscape", "vgg16-torch-2ranks-h100", "--seeds", "2",
                           "--strategies", "tunelab,random", "--first-from-model", str(path), "--no-report",
                           "--json", str(out)], check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [(r["landscape"], r["strategy"]) for r in result["rows"]] == [
        ("replay-vgg16-2nodes-10gbps", "tunelab"), ("replay-vgg16-2nodes-10gbps", "tunelab+model"),
        ("replay-vgg16-2nodes-10gbps", "random"), ("replay-vgg16-2nodes-10gbps", "random+model"),
        ("vgg16-torch-2ranks-h100", "tunelab"), ("vgg16-torch-2ranks-h100", "random")]
    land = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json")
    first, _ = landscape_proposals(path, land)
    seeded = [r for r in result["rows"] if r["strategy"].endswith("+model")]
    assert all(r["first_proposals"] == [k.as_dict() for k in first] for r in seeded)
    assert all(t["landscapes"] == 2 for t in result["scoreboard"]["targets"].values())  # the plain rows only
    assert set(result["scoreboard"]["targets"]) == {"tunelab", "random"}
    assert {s: m["landscapes"] for s, m in result["model_first"].items()} == {"tunelab": 1, "random": 1}
    assert "# tunelab+model vs tunelab, on the 1 landscapes with first proposals" in proc.stdout
    assert "first proposals from the scale model" in proc.stdout and "trained on GPUs" in proc.stdout
    # the seeded search's first two candidates are the proposals; the plain one's are not
    driver = run_once(land, "tunelab", 0, plan_for(land), 0.05, first=first)
    asked = [s.knobs for s in driver.samples if s.role == "candidate"]
    assert asked[:2] == first
    plain = run_once(land, "tunelab", 0, plan_for(land), 0.05)
    assert [s.knobs for s in plain.samples if s.role == "candidate"][:2] != first


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--first-from-model", "no-such-model.json"], "--first-from-model no-such-model.json: no such file"),
    (["--first-from-model", "m.json", "--model-file", "m.json"], "drop one"),
])
def test_bad_first_from_model_input_is_a_usage_error(tmp_path, extra, fragment):
    _model_with_a_fast_path(tmp_path).rename(tmp_path / "m.json")
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--seeds", "1", *extra, "--no-report"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_evaluate_hands_the_proposals_to_every_seeds_run(monkeypatch, tmp_path):
    from tunelab.bench import tuner
    from tunelab.model.tuner import landscape_proposals

    land = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json")
    first, _ = landscape_proposals(_model_with_a_fast_path(tmp_path), land)
    seen = []
    real = tuner.run_once

    def spy(*args, **kwargs):
        driver = real(*args, **kwargs)
        seen.append([s.knobs for s in driver.samples if s.role == "candidate"][:2])
        return driver

    monkeypatch.setattr(tuner, "run_once", spy)
    row, _ = evaluate(land, "random", 3, plan_for(land), 0.05, first=first)
    assert row["strategy"] == "random+model" and seen == [first] * 3
