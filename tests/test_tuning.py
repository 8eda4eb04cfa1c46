"""Search space, tuner and live session logic, without MPI (fake coordinator, comm and clock)."""

import math

import numpy as np
import pytest

from tunelab.knobs import Knobs
from tunelab.tuning.session import SessionPlan, TuningSession
from tunelab.tuning.space import search_space
from tunelab.tuning.tuner import Tuner

pytest.importorskip("skopt")


def test_space_excludes_pinned_knobs_and_hierarchical_on_one_node():
    assert search_space({}, 1).names == ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes")
    assert "hierarchical" in search_space({}, 2).names
    sp = search_space({"cycle_time_ms": 3.0}, 2)
    assert "cycle_time_ms" not in sp.names and sp.base.cycle_time_ms == 3.0


def test_space_round_trips_and_maps_the_lowest_fusion_bin_to_no_fusion():
    sp = search_space({}, 2)
    k = Knobs(fusion_threshold_bytes=8 << 20, cycle_time_ms=2.5, segment_bytes=1 << 20, hierarchical=True)
    assert sp.to_knobs(sp.to_point(k)) == k
    assert sp.to_knobs([13.2, 1.0, 20.0, False]).fusion_threshold_bytes == 0
    assert sp.to_point(Knobs(fusion_threshold_bytes=0))[0] == 13.0
    for point in ([28.0, 100.0, 26.0, True], [13.0, 0.1, 14.0, False]):
        Knobs(**sp.to_knobs(point).as_dict())  # always valid knobs


def landscape(k: Knobs) -> float:
    """A smooth synthetic throughput surface with its optimum inside the space."""
    f = math.log2(k.fusion_threshold_bytes) if k.fusion_threshold_bytes else 12.0
    return 100.0 - 2.0 * (f - 22.0) ** 2 - 30.0 * (math.log10(k.cycle_time_ms) - 0.3) ** 2 \
        - 1.5 * (math.log2(k.segment_bytes) - 20.0) ** 2


def test_tuner_finds_the_optimum_region_of_a_smooth_landscape():
    found = []
    for seed in range(3):
        t = Tuner(search_space({}, 1), seed=seed)
        t.tell(Knobs(), landscape(Knobs()))
        for _ in range(20):
            k = t.ask()
            t.tell(k, landscape(k))
        found.append(t.best().score)
    assert min(found) > 90.0  # the default scores about 57; the optimum is 100


def test_tuner_is_reproducible_with_a_seed():
    def run(seed):
        t = Tuner(search_space({}, 1), seed=seed)
        t.tell(Knobs(), 50.0)
        out = []
        for _ in range(6):
            k = t.ask()
            out.append(k)
            t.tell(k, landscape(k))
        return out
    assert run(4) == run(4) and run(4) != run(5)


def test_warm_start_points_reach_the_model():
    t = Tuner(search_space({}, 1), seed=0, initial_points=3)  # few random points: the warm start counts
    good = Knobs(fusion_threshold_bytes=4 << 20, cycle_time_ms=2.0, segment_bytes=1 << 20)
    t.warm_start([(good, 99.0), (Knobs(cycle_time_ms=50.0), 10.0), (Knobs(segment_bytes=1 << 24), 40.0)])
    t.tell(Knobs(), 50.0)
    assert len(t._opt.yi) == 4 and min(t._opt.yi) == pytest.approx(-99.0 / 50.0)


class FakeComm:
    rank = 0

    def bcast(self, value, root=0):
        return value


class FakeCoordinator:
    def __init__(self):
        self.knobs = Knobs()
        self.changes = []

    def set_knobs(self, knobs):
        self.changes.append(knobs)
        self.knobs = knobs


def run_session(plan, pinned=None, steps=400, speed=None):
    """Steps take 1/speed(knobs) seconds of a fake clock (default: the smooth landscape): the
    session should find fast knobs."""
    speed = speed or landscape
    coord = FakeCoordinator()
    now = [0.0]
    sp = search_space(pinned or {}, 1, base=Knobs(**(pinned or {})))
    session = TuningSession(coord, FakeComm(), samples_per_step=1.0, tuner=Tuner(sp, seed=1), plan=plan,
                            clock=lambda: now[0])
    for _ in range(steps):
        now[0] += 1.0 / speed(coord.knobs)
        if not session.step_done():
            break
    return session, coord


def test_session_measures_default_first_then_explores_remeasures_and_locks():
    plan = SessionPlan(warmup_steps=2, discard_steps=1, measure_steps=3, budget_samples=12)
    session, coord = run_session(plan)
    phases = [s.phase for s in session.samples]
    assert phases[0] == "default" and session.samples[0].knobs == Knobs()
    assert phases.count("default") + phases.count("explore") == 12
    assert phases[12:] == ["remeasure"] * (len(phases) - 12) and len(phases) - 12 >= 6
    assert session.phase == "locked" and coord.knobs == session.locked
    assert landscape(session.locked) == max(landscape(s.knobs) for s in session.samples)
    assert session.samples[0].score == pytest.approx(landscape(Knobs()))  # samples/s of that config
    assert session.stop_reason == "budget of 12 samples spent"


def test_a_gain_inside_the_noise_keeps_the_default():
    rng = np.random.default_rng(3)

    def noisy_flat(_knobs):  # every config equally fast, each step 10 % noisy
        return 100.0 * (1 + 0.1 * rng.standard_normal())

    plan = SessionPlan(warmup_steps=1, discard_steps=0, measure_steps=3, budget_samples=10, remeasure_rounds=3)
    session, coord = run_session(plan, speed=noisy_flat)
    assert session.kept_default and session.locked == Knobs() == coord.knobs
    up = session.runner_up
    assert up != Knobs() and np.mean(session.scores_of(up)) > np.mean(session.scores_of(Knobs()))
    assert min(session.scores_of(up)) <= max(session.scores_of(Knobs()))
    # A clear winner is still adopted: the smooth landscape's best is far above the default.
    session, _ = run_session(SessionPlan(warmup_steps=1, discard_steps=0, measure_steps=3, budget_samples=10))
    assert not session.kept_default and session.locked != Knobs()


def test_session_excludes_pinned_knobs_and_stops_when_everything_is_pinned():
    plan = SessionPlan(warmup_steps=1, discard_steps=0, measure_steps=2, budget_samples=8)
    session, coord = run_session(plan, pinned={"cycle_time_ms": 2.0})
    assert all(k.cycle_time_ms == 2.0 for k in coord.changes)
    pinned_all = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 2.0, "segment_bytes": 1 << 20}
    session, _ = run_session(plan, pinned=pinned_all)
    assert session.stop_reason == "every knob is pinned" and session.locked == Knobs(**pinned_all)


def test_time_budget_ends_exploration():
    plan = SessionPlan(warmup_steps=1, discard_steps=0, measure_steps=2, budget_samples=1000, time_budget_s=0.5)
    session, _ = run_session(plan, steps=5000)
    assert session.stop_reason == "time budget of 0.5 s spent" and session.phase == "locked"
