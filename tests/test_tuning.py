"""The tuning driver against synthetic landscapes with known optima (bit-exact, seeded replays), the
paired-ratio statistics, the strategies' protocols and the search space; no MPI."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from tunelab.knobs import Knobs, MiB
from tunelab.tuning import noise, stats
from tunelab.tuning.driver import Driver
from tunelab.tuning.plan import Plan
from tunelab.tuning.replay import Drift, Objective, simulate, synthetic
from tunelab.tuning.result import locked_from
from tunelab.tuning.session import TuningSession
from tunelab.tuning.space import search_space
from tunelab.tuning.strategies import STRATEGIES, CoordinateDescent, HorovodProtocol, make_strategy

pytest.importorskip("skopt")

# fusion x cycle, the default at a 1 ms cycle (the product's until 2026-11-28), far from the peaks below:
# these tests are about the protocol, not about where the product's default sits
SPACE = search_space({"segment_bytes": 4 * MiB}, 1, base=Knobs(cycle_time_ms=1.0))
GRID = {"fusion_threshold_bytes": [0, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB],
        "cycle_time_ms": [0.25, 1.0, 4.0, 16.0, 64.0]}
PEAK = Knobs(segment_bytes=4 * MiB, fusion_threshold_bytes=1 * MiB, cycle_time_ms=16.0)


def peaked(peak: Knobs, height: float = 0.3):
    """Steps/s: 1.0 far from ``peak``, 1 + height on it, smooth in log2 fusion and log cycle."""
    def speed(k: Knobs) -> float:
        f = math.log2(max(k.fusion_threshold_bytes, 64 << 10)) - math.log2(max(peak.fusion_threshold_bytes, 64 << 10))
        c = math.log2(k.cycle_time_ms) - math.log2(peak.cycle_time_ms)
        return 1.0 + height * math.exp(-(f * f + c * c) / 32.0)
    return speed


def run(land, seed, strategy="tunelab", plan=None, drift=0.05, later=None, switch_s=math.inf, steps=5000):
    driver = Driver(land.space, lambda e: make_strategy(strategy, land.space, seed + 1000 * e), plan or Plan(),
                    land.samples_per_step)
    return simulate(driver, Objective(land, seed, Drift(drift, 60.0, seed), later, switch_s), steps)


# ---- statistics -------------------------------------------------------------------------------------
def test_a_bracketed_ratio_cancels_a_linear_drift_exactly():
    refs = [(0.0, math.log(100.0)), (4.0, math.log(100.0) + 0.08)]  # the host sped up 8 % in between
    pair = stats.paired(1.0, math.log(100.0) + 0.02 + 0.10, refs)   # a 10 % faster candidate at 1/4
    assert pair.log_ratio == pytest.approx(0.10) and pair.weight2 == pytest.approx(0.75 ** 2 + 0.25 ** 2)
    assert stats.paired(5.0, 1.0, refs, bracket=True).weight2 == 1.0  # after the last reference: nearest one


def test_references_of_different_lengths_weigh_by_their_steps():
    """Hand-computed: a candidate 1/4 of the way from a 3-step to a 12-step reference block."""
    refs = [(0.0, 0.0, 3), (4.0, 0.08, 12)]
    pair = stats.paired(1.0, 0.12, refs)
    assert pair.log_ratio == pytest.approx(0.10)
    assert pair.per_step == pytest.approx(0.75 ** 2 / 3 + 0.25 ** 2 / 12)
    assert stats.paired(5.0, 0.0, refs).per_step == pytest.approx(1 / 12)  # nearest: the 12-step one
    assert stats.paired(1.0, 0.12, [r[:2] for r in refs]).per_step is None  # steps not given


def test_noise_reads_step_noise_inside_blocks_and_only_the_excess_between_references():
    rng = np.random.default_rng(0)
    quiet, loud = "quiet", "loud"
    blocks = [(quiet, list(rng.normal(0.0, 0.01, 3))) for _ in range(30)]
    blocks += [(loud, list(rng.normal(0.0, 0.05, 3))) for _ in range(30)]
    trend = np.linspace(0.0, 0.05, 30)  # a slow slide of the host between reference blocks
    refs = [list(t + rng.normal(0.0, 0.01, 3)) for t in trend]
    model = noise.estimate(blocks + [(quiet, r) for r in refs], quiet, refs)
    assert 0.007 < math.sqrt(model.step_var[quiet]) < 0.013 and 0.04 < math.sqrt(model.step_var[loud]) < 0.06
    assert model.tau2 < 0.005 ** 2 and model.df_steps > 100  # the slide is not noise
    jumpy = [list(rng.normal(0.0, 0.01, 3) + rng.normal(0.0, 0.04)) for _ in range(30)]  # a busy host
    model = noise.estimate([(quiet, r) for r in jumpy], quiet, jumpy)
    assert 0.025 < math.sqrt(model.tau2) < 0.06 and model.df(1e-6, model.tau2) < 40


def test_a_configuration_measured_in_few_steps_brings_few_degrees_of_freedom():
    """Each configuration's step variance is its own, shrunk toward the pool: its degrees of freedom are
    the blend's (Satterthwaite), few for a finalist of two short blocks, many for the reference."""
    rng = np.random.default_rng(1)
    blocks = [("few", list(rng.normal(0.0, 0.03, 3))) for _ in range(2)]
    blocks += [("many", list(rng.normal(0.0, 0.03, 3))) for _ in range(40)]
    model = noise.estimate(blocks, "many", [b for c, b in blocks if c == "many"])
    assert model.df_steps == 2 + 2 * 2 + 40 * 2
    assert 4 < model.df_of("few") < 25 and 60 < model.df_of("many") <= model.df_steps
    assert model.df_of("never measured") == model.df_steps
    # a sum of the two: dominated by the few-step finalist's term, it has about that term's df
    assert model.steps_df([(1e-3, "few"), (1e-6, "many")]) == pytest.approx(model.df_of("few"), rel=0.01)
    assert model.df(1e-3, 0.0, model.df_of("few")) == pytest.approx(model.df_of("few"))


def test_interval_is_a_t_interval_in_ratio_units():
    iv = stats.interval_of_mean(0.1, 0.02 ** 2 / 4, df=10, confidence=0.9, n=4)  # 4 ratios of sigma 0.02
    assert iv.gain == pytest.approx(math.exp(0.1)) and iv.low < iv.gain < iv.high and iv.n == 4
    half = math.log(iv.high / iv.gain)
    assert half == pytest.approx(1.8125 * 0.02 / 2, rel=1e-3)  # t(0.95, 10) x sigma / sqrt(4)
    assert "x [" in iv.text()


# ---- the driver on synthetic landscapes ----------------------------------------------------------------
def _contrast_interval(driver, cand, roles, steps, c):
    """The interval of the contrast ``c`` over the blocks (independent, each its own variance: step
    noise over its steps plus the block-level tau2), at the driver's confidence and Welch df."""
    model = driver.noise()
    config = [cand if r == "candidate" else SPACE.base for r in roles]
    step_var = np.asarray([model.step_var[k] / n for k, n in zip(config, steps)])
    c = np.asarray(c)
    steps_part, block_part = float(c @ np.diag(step_var) @ c), float(c @ (model.tau2 * np.eye(len(c))) @ c)
    # the step part's df: Satterthwaite over the candidate's and the reference's own variance estimates
    mine = sum(ci * ci * v for ci, v, k in zip(c, step_var, config) if k == cand)
    theirs = steps_part - mine
    df_steps = steps_part ** 2 / (mine ** 2 / model.df_of(cand) + theirs ** 2 / model.df_of(SPACE.base))
    mean = float(c @ np.asarray([s.log_score for s in driver.samples]))
    return mean, noise.t_quantile(0.9, model.df(steps_part, block_part, df_steps)) * math.sqrt(steps_part + block_part)


@pytest.mark.parametrize("layout", ["alternating", "uneven"])
def test_a_re_measured_gain_counts_each_reference_block_once_in_its_variance(layout):
    """F R F R F R: each reference between two re-measurements is subtracted from both ratios, so the mean
    ratio is one linear contrast of the blocks, and its variance is that contrast's, c' S c, with S the
    blocks' own variances (independent blocks), not the sum of the ratios' variances as if independent
    (which counts the shared references' noise at half its weight: too narrow an interval).  The uneven
    layout has references of 8, 12 and 4 steps, two candidates between one pair (weights 2/3 and 1/3),
    and a last candidate with no reference after it (paired with the one before, weight 1)."""
    from tunelab.tuning.plan import Sample

    cand = SPACE.base.replace(fusion_threshold_bytes=1 * MiB)
    if layout == "alternating":
        roles, steps = ["reference"] + ["candidate", "reference"] * 4, [8] * 9
        # +1/4 on each candidate, -1/8 on each reference next to one candidate, -1/4 between two
        c = [-1 / 8] + [1 / 4, -1 / 4] * 3 + [1 / 4, -1 / 8]
    else:
        roles = ["reference", "candidate", "reference", "candidate", "candidate", "reference", "candidate"]
        steps = [8, 8, 12, 8, 8, 4, 8]
        # candidates at 1 (refs 0, 2: 1/2 each), 3 and 4 (refs 2, 5: 2/3 and 1/3, then 1/3 and 2/3), 6 (ref 5)
        c = [-0.5 / 4, 1 / 4, -(0.5 + 2 / 3 + 1 / 3) / 4, 1 / 4, 1 / 4, -(1 / 3 + 2 / 3 + 1) / 4, 1 / 4]
    rng = np.random.default_rng(3)
    driver = Driver(SPACE, lambda e: make_strategy("random", SPACE, 0), Plan())
    for role, k in zip(roles, steps):
        knobs = cand if role == "candidate" else SPACE.base
        logs = tuple(float(x) for x in rng.normal(0.03 if role == "candidate" else 0.0, 0.05, k))
        driver.samples.append(Sample(len(driver.samples), "remeasure", role, knobs, math.exp(np.mean(logs)), 0.0,
                                     k, 1.0, 1.0, 0, None, logs))
    mean, half = _contrast_interval(driver, cand, roles, steps, c)
    iv = driver.interval_of(cand)
    assert iv.n == roles.count("candidate") and math.log(iv.gain) == pytest.approx(mean)
    assert math.log(iv.gain / iv.low) == pytest.approx(half, rel=1e-9)
    assert math.log(iv.high / iv.gain) == pytest.approx(half, rel=1e-9)


def test_replay_is_bit_exact_for_a_seed():
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.03, seed=1)
    a, b, c = run(land, 3), run(land, 3), run(land, 4)
    assert [(s.knobs, s.score) for s in a.samples] == [(s.knobs, s.score) for s in b.samples]
    assert [(s.knobs, s.score) for s in a.samples] != [(s.knobs, s.score) for s in c.samples]


def test_driver_finds_a_planted_optimum_through_noise_and_drift():
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.03, seed=1)
    assert land.knobs[int(np.argmax(land.means))] == PEAK
    near = 0
    for seed in range(4):
        driver = run(land, seed)
        d = driver.decisions[0]
        # the protocol stops at "good enough and safe": within 5 % always, within 3 % on most seeds
        assert d.adopted and land.true_score(d.knobs) >= 0.95 * land.best, seed
        near += land.true_score(d.knobs) >= 0.97 * land.best
        assert d.interval.low >= 1.01 and d.samples == len(driver.samples)
    assert near >= 3


def test_driver_measures_the_reference_first_and_between_candidates():
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.03, seed=1)
    driver = run(land, 0)
    roles = [s.role for s in driver.samples]
    assert roles[0] == "reference" and driver.samples[0].knobs == SPACE.base
    gaps = np.diff([i for i, r in enumerate(roles) if r == "reference"]) - 1
    assert gaps.max() <= Plan().reference_every
    assert driver.samples[-1].role == "reference"  # the last finalist is bracketed too


def test_flat_landscape_with_drift_keeps_the_default_and_says_why():
    land = synthetic("flat", SPACE, GRID, lambda k: 1.0, noise=0.04, seed=2)
    for seed in range(6):
        d = run(land, seed, drift=0.10).decisions[0]
        assert not d.adopted and d.knobs == SPACE.base, seed
        assert d.reason and (d.interval is None or d.interval.low < 1.01)


def test_a_budget_of_the_reference_alone_keeps_the_default_and_says_nothing_was_measured():
    """A budget of one block is the default's reference block and nothing else: the default is kept,
    and the reason says no candidate was measured, not that none is expected to reach the gain."""
    land = synthetic("peak", SPACE, GRID, peaked(PEAK, 0.6), noise=0.01, seed=3)
    driver = run(land, 0, plan=dataclasses.replace(Plan(), budget_samples=1))
    d = driver.decisions[0]
    assert [s.role for s in driver.samples] == ["reference"]
    assert not d.adopted and d.knobs == SPACE.base and "no candidate was measured" in d.reason, d.reason
    assert "no candidate" not in run(land, 0, plan=dataclasses.replace(Plan(), budget_samples=2)).decisions[0].reason


def test_never_locks_a_configuration_whose_interval_includes_the_default():
    lands = [synthetic("small", SPACE, GRID, peaked(PEAK, 0.03), noise=0.05, seed=5),
             synthetic("flat", SPACE, GRID, lambda k: 1.0, noise=0.06, seed=6)]
    decisions = [run(land, seed, strategy=s, drift=0.08).decisions[0]
                 for land in lands for seed in range(3) for s in ("tunelab", "random")]
    for d in decisions:
        if d.adopted:
            assert d.interval.low >= 1.0 + Plan().min_gain > 1.0
        else:
            assert d.knobs == SPACE.base


def test_a_gain_far_above_the_noise_locks_from_exploration_with_a_simultaneous_interval():
    """When the explored blocks of the chosen configuration already clear the minimum gain with an
    interval that holds for every configuration explored at once (each at confidence 1 - 0.1 / 2m, the
    block-level noise at its upper limit), no re-measurement is spent; its interval is that wider one:
    at least as wide as the t-quantile alone makes it (the bound can only widen it).  A small gain still goes through
    re-measurement.  (Random search picks the best measured configuration, so its pick always has
    exploration blocks; the GP's pick is often an unmeasured point, which is re-measured.)"""
    from tunelab.tuning.noise import t_quantile

    strong = synthetic("strong", SPACE, GRID, peaked(PEAK, 0.6), noise=0.01, seed=3)
    for seed in range(3):
        driver = run(strong, seed, strategy="random", drift=0.02)
        d = driver.decisions[0]
        assert d.adopted and "simultaneous" in d.reason, (seed, d.reason)
        assert not [s for s in driver.samples if s.phase == "remeasure"]
        m = len({s.knobs for s in driver.samples if s.role == "candidate"})
        blocks = [s for s in driver.samples if s.knobs == d.knobs and s.role == "candidate"]
        plain = driver.interval_of(d.knobs, phase="explore")  # the same blocks at the plan's 90 %
        assert m >= 2 and plain.n == len(blocks) and d.interval.n == len(blocks)
        assert d.interval.gain == pytest.approx(plain.gain)
        # the same blocks, the half-width scaled at least from t at 90 % to t at 1 - 0.1 / 2m (the normal
        # quantiles' ratio: the smallest whatever the df), and more where the block noise is bounded
        wide, narrow = math.log(d.interval.high / d.interval.low), math.log(plain.high / plain.low)
        assert wide / narrow >= 0.999 * t_quantile(1 - 0.05 / m, 1e6) / t_quantile(0.9, 1e6)
        assert wide > narrow * 1.2 and d.interval.low >= 1.01
    small = synthetic("small", SPACE, GRID, peaked(PEAK, 0.04), noise=0.03, seed=4)
    driver = run(small, 0, strategy="random")
    assert not any("simultaneous" in d.reason for d in driver.decisions)
    assert [s for s in driver.samples if s.phase == "remeasure"]


def test_retune_reopens_and_relocks_when_the_optimum_moves():
    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.02, seed=7)
    moved = PEAK.replace(fusion_threshold_bytes=0, cycle_time_ms=64.0)  # far from the default and the old peak
    later = synthetic("after", SPACE, GRID, lambda k: peaked(moved, 0.4)(k) * (2.0 - peaked(PEAK)(k)),
                      noise=0.02, seed=8)  # the old peak is now slow
    assert later.true_score(PEAK) < 0.92 * later.best
    plan = Plan(retune=True)
    relocked_near = improved = 0
    for seed in range(4):
        once = run(first, seed, plan=Plan())
        switch_s = 1.5 * sum(s.seconds for s in once.samples)  # the optimum moves well after the first lock
        driver = run(first, seed, plan=plan, later=later, switch_s=switch_s, steps=1500)
        assert len(driver.decisions) >= 2 and driver.decisions[0].adopted and driver.samples[-1].epoch >= 1, seed
        old, new = driver.decisions[0].knobs, driver.decisions[-1].knobs
        improved += later.true_score(new) > later.true_score(old)
        relocked_near += later.true_score(new) >= 0.9 * later.best
    # (a search warm-started with the trials from before the move sometimes locks the old configuration
    # again, still ahead of the default: 1 of 16 seeds today)
    assert improved >= 3 and relocked_near >= 3
    # without the move the locked configuration stays put
    steady = run(first, 0, plan=plan, steps=1500)
    assert len(steady.decisions) == 1


class _Pessimist(STRATEGIES["random"]):
    """Random proposals, one planted among them, and a model that expects nothing to reach the goal (a GP
    that smoothed a real gain away on a noisy host)."""

    def __init__(self, space, seed, planted):
        super().__init__(space, seed)
        self.planted, self.asked = planted, 0

    def ask(self):
        self.asked += 1
        return self.planted if self.asked == 2 else super().ask()

    def estimate(self, knobs):
        return -0.05, 0.01

    def upper_bound(self, z):
        return -0.05

    def recommend(self):
        return self.space.base


def test_a_measured_gain_is_remeasured_before_the_search_gives_up():
    fast = PEAK
    land = synthetic("one-fast", SPACE, GRID, lambda k: 1.08 if k == fast else 1.0, noise=0.02, seed=9)
    driver = Driver(SPACE, lambda e: _Pessimist(SPACE, e, fast), Plan(), land.samples_per_step)
    d = simulate(driver, Objective(land, 0, Drift(0.03, 60.0, 0))).decisions[0]
    explored = [s for s in driver.samples if s.knobs == fast and s.phase == "explore"]
    assert explored and math.exp(explored[0].told) >= 1.01  # measured above the goal once ...
    assert any(s.knobs == fast and s.phase == "remeasure" for s in driver.samples)  # ... so re-measured
    assert d.adopted and d.knobs == fast and d.interval.low >= 1.01
    # nothing measured above the goal: the futile search still stops without re-measuring
    flat = synthetic("flat", SPACE, GRID, lambda k: 0.9 if k != SPACE.base else 1.0, noise=0.01, seed=9)
    driver = Driver(SPACE, lambda e: _Pessimist(SPACE, e, fast), Plan(), flat.samples_per_step)
    d = simulate(driver, Objective(flat, 0)).decisions[0]
    assert not d.adopted and "converged (nothing" in d.stop_reason
    assert not any(s.phase == "remeasure" for s in driver.samples)


class _Planted(STRATEGIES["random"]):
    """Random proposals with ``fast`` planted among them (the second)."""

    def __init__(self, space, seed, fast):
        super().__init__(space, seed)
        self.fast, self.asked = fast, 0

    def ask(self):
        self.asked += 1
        return self.fast if self.asked == 2 else super().ask()


class _SecondThoughts(_Planted):
    """``fast`` planted; it recommends ``slow`` (never explored) until the driver has re-measured
    something, then ``fast``."""

    def __init__(self, space, seed, fast, slow, driver_of):
        super().__init__(space, seed, fast)
        self.slow, self.driver_of = slow, driver_of

    def recommend(self):
        remeasured = any(s.phase == "remeasure" for s in self.driver_of().samples)
        return self.fast if remeasured else self.slow

    def estimate(self, knobs):  # (``slow`` well ahead of the rest: no explored stand-in for it)
        return (0.3 if knobs == self.slow else 0.2), 0.01

    def upper_bound(self, z):
        return 0.3


def test_after_a_re_measurement_exploration_blocks_alone_do_not_lock():
    """A search whose first finalist failed its re-measurement resumes; the configuration it picks
    next is re-measured too, although its exploration blocks would clear a simultaneous interval."""
    fast, slow = PEAK, PEAK.replace(fusion_threshold_bytes=64 * MiB, cycle_time_ms=0.25)
    land = synthetic("fast", SPACE, GRID, lambda k: 1.5 if k == fast else 1.0, noise=0.01, seed=9)
    box = []
    driver = Driver(SPACE, lambda e: _SecondThoughts(SPACE, e, fast, slow, lambda: box[0]),
                    Plan(budget_samples=30), land.samples_per_step)
    box.append(driver)
    d = simulate(driver, Objective(land, 0, Drift(0.01, 60.0, 0))).decisions[0]
    assert any(s.knobs == slow and s.phase == "remeasure" for s in driver.samples)  # the first finalist
    assert d.adopted and d.knobs == fast and "simultaneous" not in d.reason, d.reason
    assert any(s.knobs == fast and s.phase == "remeasure" for s in driver.samples)
    # the same search with the first finalist dropped by exploration alone: locked from exploration
    box.clear()
    driver = Driver(SPACE, lambda e: _SecondThoughts(SPACE, e, fast, fast, lambda: box[0]), Plan(), land.samples_per_step)
    box.append(driver)
    d = simulate(driver, Objective(land, 0, Drift(0.01, 60.0, 0))).decisions[0]
    assert d.knobs == fast and "simultaneous" in d.reason


class _Unmeasured(_Planted):
    """``fast`` planted; it recommends ``guess`` (never explored) and expects it ``ahead`` (log units)
    of ``fast``, the rest behind both."""

    def __init__(self, space, seed, fast, guess, ahead):
        super().__init__(space, seed, fast)
        self.guess, self.ahead = guess, ahead

    def recommend(self):
        return self.guess

    def ranked(self):
        return [self.fast, *[k for k in super().ranked() if k != self.fast]]

    def estimate(self, knobs):
        return {self.guess: 0.3 + self.ahead, self.fast: 0.3}.get(knobs, 0.0), 0.01

    def upper_bound(self, z):
        return 0.3 + self.ahead


def test_an_unmeasured_pick_little_ahead_of_the_best_explored_one_is_not_worth_a_round():
    """The model picks a configuration nobody measured, expected at most ``near_best`` (2 %) ahead of the
    best explored one, whose own exploration blocks clear the minimum gain with the simultaneous
    interval: that one is locked on its blocks, and no round is spent confirming the guess.  Expected
    further ahead, the guess is re-measured; so it is when the model holds trials from before this
    search, whose comparison this search cannot vouch for."""
    fast, guess = PEAK, PEAK.replace(fusion_threshold_bytes=4 * MiB)
    land = synthetic("fast", SPACE, GRID, lambda k: 1.5 if k == fast else 1.0, noise=0.01, seed=9)

    def search(ahead, warm=()):
        def make(epoch):
            strategy = _Unmeasured(SPACE, epoch, fast, guess, ahead)
            strategy.warm_start(list(warm))
            return strategy
        driver = Driver(SPACE, make, Plan(), land.samples_per_step)
        return simulate(driver, Objective(land, 0, Drift(0.01, 60.0, 0)))

    driver = search(0.015)
    d = driver.decisions[0]
    assert d.adopted and d.knobs == fast and d.reason.startswith("the best explored configuration's blocks"), d.reason
    assert locked_from(driver, d) == "exploration"  # (what the report says its interval rests on)
    assert not [s for s in driver.samples if s.phase == "remeasure"] and d.interval.low >= 1.01
    assert d.interval.n == len([s for s in driver.samples if s.knobs == fast and s.role == "candidate"])
    driver = search(0.05)  # expected 5 % ahead: worth a round
    assert [s for s in driver.samples if s.knobs == guess and s.phase == "remeasure"]
    d = driver.decisions[0]
    assert locked_from(driver, d) == ("re-measurement" if d.adopted else None)
    from tunelab.tuning.strategies import Observation
    driver = search(0.015, warm=[Observation(guess, 0.3, 0.01)])  # a stored trial: the model's to vouch for
    assert [s for s in driver.samples if s.knobs == guess and s.phase == "remeasure"]


def test_re_measurement_blocks_grow_with_the_step_noise():
    """Steps of a re-measurement block: enough that a round's paired ratio has a 2 % step sigma
    ((candidate's step variance + the reference's) / 0.02^2), between measure_steps (3) and 4 x it.
    A quiet host (1 % per step: under one step wanted) keeps 3; a noisy one (10 %: about 50 wanted) is
    capped at 12; exploration blocks stay at 3 either way."""
    fast = SPACE.base.replace(fusion_threshold_bytes=GRID["fusion_threshold_bytes"][1])
    for step_noise, want in ((0.01, 3), (0.10, 12)):
        land = synthetic("one-fast", SPACE, GRID, lambda k: 1.3 if k == fast else 1.0, noise=step_noise, seed=9)
        for seed in range(4):
            driver = run(land, seed, plan=Plan(lock_from_exploration=False), drift=0.0)
            remeasured = {s.steps for s in driver.samples if s.phase == "remeasure"}
            assert {s.steps for s in driver.samples if s.phase == "explore"} == {3}
            if remeasured:
                assert remeasured == {want}, (step_noise, seed, remeasured)
                break
        else:
            raise AssertionError(f"no seed re-measured at noise {step_noise}")
    land = synthetic("one-fast", SPACE, GRID, lambda k: 1.3 if k == fast else 1.0, noise=0.10, seed=9)
    fixed = run(land, 0, plan=Plan(lock_from_exploration=False, remeasure_steps=5), drift=0.0)
    assert {s.steps for s in fixed.samples if s.phase == "remeasure"} == {5}


def test_blocks_last_a_second_where_steps_are_fast_sized_once_from_the_fastest_warm_up_step():
    """A GPU step can take 30 ms where a CPU one takes a second: blocks of ``measure_steps`` steps would
    last 0.1 s there, too short to tell a 10 % gain from step noise.  The driver sizes every block of a
    run once, from the fastest warm-up step, to last at least ``block_seconds``."""
    slow = synthetic("slow", SPACE, GRID, peaked(PEAK), noise=0.02, seed=1)  # steps of 0.8-1 s
    fast = synthetic("fast", SPACE, GRID, lambda k: 40.0 * peaked(PEAK)(k), noise=0.02, seed=1)  # 20-25 ms
    remeasured_any = 0
    for land, expect in ((slow, 3), (fast, None)):
        d = run(land, 0, plan=Plan(lock_from_exploration=False))  # (so that it re-measures)
        measured = [s.steps for s in d.samples if s.phase == "explore"]
        if expect is None:  # ceil(1 s / the fastest of the two warm-up steps, both at the default: ~25 ms)
            assert 38 <= d.block_steps <= 44
            expect = d.block_steps
        assert set(measured) == {expect} and d.block_steps == expect
        remeasured = [s.steps for s in d.samples if s.phase == "remeasure"]
        assert all(expect <= n <= 4 * expect for n in remeasured)
        remeasured_any += len(remeasured)
    assert remeasured_any  # (the bound above was checked on some re-measurement blocks)
    assert run(fast, 0, plan=Plan(block_seconds=None)).block_steps == 3
    assert run(fast, 0, plan=Plan(block_seconds=0.5)).block_steps < 25
    d = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan(warmup_steps=3))
    for step_s in (2.0, 0.1, 0.5, 0.2):  # a slow first step (allocation, autotuning) does not shrink blocks
        d.step_done(step_s)
    assert d.block_steps == 10
    watched = Driver.watching(SPACE, lambda e: make_strategy("tunelab", SPACE, e), PEAK, Plan(warmup_steps=2))
    for step_s in (0.05, 0.04, 0.3):  # its warm-up is the locked block's discarded steps
        watched.step_done(step_s)
    assert watched.block_steps == 25
    with pytest.raises(ValueError, match="block_seconds"):
        Plan(block_seconds=0.0)


def test_second_long_blocks_find_a_planted_optimum_that_fast_noisy_steps_hide():
    """Fast steps with 20 % noise each (ranks time-slicing one GPU): blocks of three steps rarely find
    anything within 3 % of the best, blocks of a second often do (over 40 seeds 4 and 14 runs; in
    these 16, 0 and 4), and neither locks anything worse than the default.  (With three-step blocks a
    run can fail re-measurement and resume exploration several times; while every re-measurement
    tested at the plan's confidence, one run of the 40 locked a configuration 0.971 of the default's
    speed as 1.113x [1.011, 1.225] in its second.)"""
    land = synthetic("fast", SPACE, GRID, lambda k: 25.0 * peaked(PEAK, 0.15)(k), noise=0.2, seed=3,
                     steps_per_visit=10)
    best = max(land.true_score(k) for k in land.knobs)
    found = {}
    for seconds in (None, 1.0):
        locked = [run(land, seed, plan=Plan(block_seconds=seconds, budget_samples=20)).locked for seed in range(16)]
        found[seconds] = sum(land.true_score(k) >= 0.97 * best for k in locked)
        assert all(land.true_score(k) >= 0.99 * land.true_score(land.space.base) for k in locked)
    assert found[1.0] >= found[None] + 3, found


def test_a_time_budget_ends_the_search_near_it_with_a_decision():
    """``time_budget_s`` bounds the whole search (warm-up, exploration, re-measurement), not exploration
    alone: the decision comes within the budget and a block of it, after re-measuring when exploration
    left a finalist, and a budget too long to bind changes nothing (the same blocks, bit for bit)."""
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.03, seed=1)
    free = run(land, 0, plan=Plan(budget_samples=1000))
    assert free.decisions[0].seconds > 60.0  # (so that the budgets below bind)
    remeasured = timed = 0
    for budget, seed in itertools.product((20.0, 40.0, 60.0), range(4)):
        driver = run(land, seed, plan=Plan(budget_samples=1000, time_budget_s=budget))
        d = driver.decisions[0]
        timed += d.stop_reason.startswith(f"time budget of {budget:g} s spent") and not d.converged
        one_block = max(s.seconds for s in driver.samples) * 1.5  # (its discarded step included)
        assert d.seconds <= budget + one_block, (budget, seed, d.seconds)
        remeasured += any(s.phase == "remeasure" for s in driver.samples)
        assert d.interval is None or not d.adopted or d.interval.low >= 1.01  # still the lock's rule
    assert timed >= 10 and remeasured >= 8  # the budget ended most, and left re-measurement its time
    for steps in (None, 2):  # (re-measurement blocks sized by the noise, or as the plan sets them)
        plain = run(land, 1, plan=Plan(budget_samples=20, remeasure_steps=steps))
        roomy = run(land, 1, plan=Plan(budget_samples=20, remeasure_steps=steps, time_budget_s=1e6))
        assert [(s.knobs, s.logs) for s in plain.samples] == [(s.knobs, s.logs) for s in roomy.samples]
        assert plain.decisions == roomy.decisions
    with pytest.raises(ValueError, match="time_budget_s=0"):
        Plan(time_budget_s=0.0)


def test_pinned_everything_ends_exploration():
    pinned = search_space({"fusion_threshold_bytes": MiB, "cycle_time_ms": 2.0, "segment_bytes": MiB}, 1)
    driver = Driver(pinned, lambda e: make_strategy("tunelab", pinned, e), Plan())
    for _ in range(20):
        driver.step_done(0.1)
    assert driver.decisions[0].stop_reason == "every knob is pinned" and driver.locked == pinned.base
    assert driver.decisions[0].reason == "every knob is pinned: there is nothing to search"


# ---- strategies ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_asks_inside_the_space_and_locks_through_the_driver(name):
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.03, seed=1)
    strategy = make_strategy(name, SPACE, 0)
    for _ in range(12):
        k = strategy.ask()
        assert k.segment_bytes == 4 * MiB and Knobs(**k.as_dict()) == k  # pinned knob kept, valid knobs
        strategy.tell(k, 0.0, 0.01)
    driver = run(land, 0, strategy=name)
    assert driver.decisions and not driver.tuning


def test_horovod_protocol_starts_from_its_fixed_points_per_boolean_combination():
    space = search_space({"segment_bytes": 4 * MiB}, 2)
    h = HorovodProtocol(space, seed=0)
    asked = []
    for _ in range(23):
        asked.append(h.ask())
        h.tell(asked[-1], 0.0, 0.01)
    assert [(k.fusion_threshold_bytes // MiB, k.cycle_time_ms) for k in asked[:4]] == [(4, 5.0), (32, 50.0),
                                                                                        (16, 25.0), (8, 10.0)]
    assert {k.hierarchical for k in asked[:21]} == {False} and asked[21].hierarchical
    assert (asked[21].fusion_threshold_bytes, asked[21].cycle_time_ms) == (4 * MiB, 5.0)


def test_a_retold_observation_is_replaced_in_every_model_that_holds_it():
    """Horovod's protocol keeps its observations twice (all of them, and its current combination's GP's);
    the GP strategy refits on the new value."""
    h = HorovodProtocol(SPACE, seed=0)
    asked = [h.ask() for _ in range(3)]
    for i, k in enumerate(asked):
        h.tell(k, 0.1 * i, 0.01)
    h.retell(1, 0.5, 0.002)
    assert [(o.value, o.variance) for o in h.observations] == [(0.0, 0.01), (0.5, 0.002), (0.2, 0.01)]
    assert h._search.observations == h.observations
    g = make_strategy("tunelab", SPACE, 0)
    for i, k in enumerate(asked):
        g.tell(k, 0.1 * i, 0.01)
    before = g.estimate(asked[1])[0]
    g.retell(1, 0.5, 0.002)
    assert g.estimate(asked[1])[0] > before + 0.1 and len(g.observations) == 3


def test_coordinate_descent_moves_one_knob_at_a_time_and_keeps_the_better_value():
    cd = CoordinateDescent(SPACE, seed=0, values_per_knob=3, sweeps=1)
    first = cd.ask()
    line = []
    while not cd.converged() and len(line) < 20:
        k = cd.ask()
        line.append(k)
        cd.tell(k, 0.2 if k.fusion_threshold_bytes == first.fusion_threshold_bytes else -0.1, 0.01)
    fusion_moves = [k for k in line if k.cycle_time_ms == SPACE.base.cycle_time_ms]
    assert fusion_moves and all(k.cycle_time_ms == SPACE.base.cycle_time_ms for k in line[:len(fusion_moves)])
    assert cd.incumbent.fusion_threshold_bytes == first.fusion_threshold_bytes and cd.converged()


def test_seeded_coordinate_descent_walks_from_a_given_point_that_measured_better():
    """A setting asked first from elsewhere (the scale model's proposals) that measured better than the
    default becomes the incumbent: every line then varies one knob of it, not of the default; a given
    setting that measured worse is left, and the walk starts from the default as without it."""
    from tunelab.tuning.strategies import SeededStrategy

    given = SPACE.base.replace(fusion_threshold_bytes=32 * MiB, cycle_time_ms=20.0)
    for value, start in ((0.3, given), (-0.3, SPACE.base)):
        cd = SeededStrategy(CoordinateDescent(SPACE, seed=0, values_per_knob=3, sweeps=1), [given])
        assert cd.ask() == given
        cd.tell(given, value, 0.01)
        line = [cd.ask()]
        cd.tell(line[0], -0.5, 0.01)
        line.append(cd.ask())
        changed = [{n for n in SPACE.names if getattr(k, n) != getattr(start, n)} for k in line]
        assert all(len(c) == 1 for c in changed), (start, line)


# ---- the search space ---------------------------------------------------------------------------------
def test_space_excludes_pinned_knobs_and_hierarchical_on_one_node():
    assert search_space({}, 1).names == ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes")
    assert "hierarchical" in search_space({}, 2).names
    # nodes of unequal size cannot run hierarchical (the engine refuses it): not searched there
    assert "hierarchical" not in search_space({}, 2, uniform_nodes=False).names
    from tunelab.bench.landscape import grid_space

    with pytest.raises(ValueError, match="nodes of unequal size"):
        grid_space({"hierarchical": [False, True]}, {}, 2, uniform_nodes=False)
    sp = search_space({"cycle_time_ms": 3.0}, 2)
    assert "cycle_time_ms" not in sp.names and sp.base.cycle_time_ms == 3.0


def test_space_round_trips_and_maps_the_lowest_fusion_bin_to_no_fusion():
    sp = search_space({}, 2)
    k = Knobs(fusion_threshold_bytes=8 << 20, cycle_time_ms=2.5, segment_bytes=1 << 20, hierarchical=True)
    assert sp.to_knobs(sp.to_point(k)) == k and sp.from_unit(sp.unit_point(k)) == k
    assert sp.to_knobs([13.2, 1.0, 20.0, False]).fusion_threshold_bytes == 0
    assert sp.to_point(Knobs(fusion_threshold_bytes=0))[0] == 13.0
    for u in ([0.0] * 4, [1.0] * 4):
        Knobs(**sp.from_unit(u).as_dict())  # always valid knobs


# ---- the live session is the driver fed by a clock ------------------------------------------------------
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


def test_session_applies_the_drivers_knobs_and_ends_on_the_locked_ones():
    speed = peaked(PEAK)
    coord, now = FakeCoordinator(), [0.0]
    coord.knobs = SPACE.base
    session = TuningSession(coord, FakeComm(), 1.0, SPACE, lambda e: make_strategy("tunelab", SPACE, e),
                            Plan(), clock=lambda: now[0])
    for _ in range(2000):
        now[0] += 1.0 / speed(coord.knobs)
        if not session.step_done():
            break
    assert session.phase == "locked" and coord.knobs == session.locked != SPACE.base
    assert coord.changes[0] != SPACE.base  # the default is measured as it is: no change first
    assert session.driver.samples[0].score == pytest.approx(speed(SPACE.base))


def test_a_measured_step_never_holds_the_decision_taken_after_the_step_before():
    """Steps of exactly 0.1 s, and a strategy whose every proposal takes 0.5 s (a GP fit on a loaded
    host) and repeats its last candidate every other time: a block after no knob change has no discarded
    step, so the decision's time once landed in its first measured step (0.6 s: that candidate scored
    5.5 steps/s where every block runs at 10)."""
    now = [0.0]

    class _Slow(STRATEGIES["random"]):
        def ask(self):
            now[0] += 0.5
            if len(self.observations) % 2 and self.observations:
                return self.observations[-1].knobs
            return super().ask()

    plan = Plan(warmup_steps=2, discard_steps=1, measure_steps=3, block_seconds=None, budget_samples=8)
    session = TuningSession(FakeCoordinator(), FakeComm(), 1.0, SPACE, lambda e: _Slow(SPACE, e), plan,
                            clock=lambda: now[0])
    for _ in range(500):
        now[0] += 0.1
        if not session.step_done():
            break
    samples = session.driver.samples
    assert len(samples) >= 6 and any(a.knobs == b.knobs for a, b in itertools.pairwise(samples))
    assert [round(s.score, 9) for s in samples] == [10.0] * len(samples)


def test_the_strategy_learns_each_candidates_bracketed_ratio_once_the_next_reference_is_measured():
    """A host that slows down steadily (2 % of speed per block), noise-free steps, and three candidates
    5, 10 and 15 % faster than the default.  Told right after its block, a candidate's ratio is against
    the reference before it, so the slowdown since then reads as a loss (1-3 blocks: 2-6 %); once the
    reference after it is measured, the strategy holds its bracketed ratio instead, in which a linear
    drift cancels: exactly the planted gain, one observation per block (replaced, not added)."""
    gains = [0.05, 0.10, 0.15]
    cands = [SPACE.base.replace(fusion_threshold_bytes=f) for f in (256 << 10, 1 * MiB, 4 * MiB)]

    class _Fixed(STRATEGIES["random"]):
        def ask(self):
            return cands[min(len(self.observations), 2)]

    plan = Plan(warmup_steps=1, discard_steps=0, measure_steps=3, block_seconds=None, reference_every=3,
                budget_samples=5)
    driver = Driver(SPACE, lambda e: _Fixed(SPACE, e), plan)
    told_before_ref = []
    for _ in range(200):
        block = len(driver.samples)
        if driver.samples and driver.samples[-1].role == "candidate" and len(driver.samples) == 4:
            told_before_ref = [o.value for o in driver.strategy.observations]
        level = -0.02 * block + (gains[cands.index(driver.knobs)] if driver.knobs in cands else 0.0)
        driver.step_done(math.exp(-level))
        if len(driver.samples) >= 5:
            break
    assert [s.role for s in driver.samples] == ["reference", "candidate", "candidate", "candidate", "reference"]
    assert told_before_ref == pytest.approx([g - 0.02 * k for g, k in zip(gains, (1, 2, 3))])
    obs = driver.strategy.observations
    assert [o.knobs for o in obs] == cands
    assert [o.value for o in obs] == pytest.approx(gains)
    assert [s.told for s in driver.samples[1:4]] == pytest.approx(gains)


def test_candidates_next_to_a_reference_found_disturbed_later_are_withdrawn_from_the_strategy():
    """The second reference block runs 40 % slow (the host busy for a whole block).  It can be set
    aside only once four references exist, after the candidates on both sides of it were told; then
    they are withdrawn from what the strategy models (their ratios against it read 14-53 % gains where
    every candidate is 2 % faster), and the others keep their bracketed 2 %."""
    cands = [SPACE.base.replace(fusion_threshold_bytes=f, cycle_time_ms=c)
             for f in (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB) for c in (1.0, 4.0, 16.0)]

    class _Fixed(STRATEGIES["random"]):
        def ask(self):
            return cands[len(self.observations) % len(cands)]

    plan = Plan(warmup_steps=1, discard_steps=0, measure_steps=3, block_seconds=None, reference_every=3,
                budget_samples=16, explore_first=12)
    driver = Driver(SPACE, lambda e: _Fixed(SPACE, e), plan)
    rng = np.random.default_rng(0)
    while len(driver.samples) < 17:
        block = len(driver.samples)
        level = math.log(0.6) if block == 4 else (0.0 if driver.knobs == SPACE.base else 0.02)
        driver.step_done(math.exp(-(level + rng.normal(0.0, 0.003))))
    assert "".join(s.role[0] for s in driver.samples) == "rcccrcccrcccrcccr"
    assert driver.disturbed_references() == 1
    told = [s.told for s in driver.samples if s.role == "candidate"]
    assert told[:6] == [None] * 6 and told[6:] == pytest.approx([0.02] * 6, abs=0.006)
    assert [o.value for o in driver.strategy.live] == pytest.approx([0.02] * 6, abs=0.006)
    assert len(driver.strategy.observations) == 12  # withdrawn, not removed: indices still point right
    assert driver.strategy.ranked() and all(k in cands[6:] for k in driver.strategy.ranked())


def test_a_disturbed_reference_block_is_set_aside():
    land = synthetic("peak", SPACE, GRID, peaked(PEAK), noise=0.02, seed=1)
    driver = run(land, 0, plan=Plan(explore_first=9))  # nine candidates at least: four references
    refs = driver._refs()
    assert driver.disturbed_references() == 0 and len(refs) >= 4
    # the host busy for a whole block: that reference reads 40 % slow and must not pair with anything
    from dataclasses import replace

    i = next(k for k, s in enumerate(driver.samples) if s.role == "reference" and k > 3)
    slow = tuple(x + math.log(0.6) for x in driver.samples[i].logs)
    driver.samples[i] = replace(driver.samples[i], score=driver.samples[i].score * 0.6, logs=slow)
    assert driver.disturbed_references() == 1 and float(i) not in [r[0] for r in driver._refs()]


def _blocks(driver, sequence, spread=0.01):
    """Hand-built blocks: (role, knobs, mean log rate) in measured order, three steps each (+-``spread``)."""
    from tunelab.tuning.plan import Sample

    for role, knobs, level in sequence:
        logs = (level - spread, level, level + spread)
        driver.samples.append(Sample(len(driver.samples), "remeasure", role, knobs, math.exp(level), 0.02, 3,
                                     3.0, 3.0 * len(driver.samples), 0, None, logs))


@pytest.mark.parametrize("shared", [True, False])
def test_a_disturbed_reference_takes_the_blocks_next_to_it_out_of_the_gain(shared):
    """A candidate 2 % faster than the reference, measured between references; one reference block reads
    12 % off.  Shared: the host ran fast for a stretch and the candidate blocks on both sides of that
    reference ran fast with it; set aside on the reference's side only, they would be paired with the
    references around the stretch and read as a 7 % gain.  Not shared: only the reference was
    disturbed (slow), which paired with the blocks next to it reads as about 8 % on each.  Either way the
    gain is the 2 % the other blocks measure, exactly (every block of the candidate reads the same)."""
    driver = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan())
    cand = SPACE.base.replace(fusion_threshold_bytes=1 * MiB)
    refs = [0.0, 0.0, 0.0, 0.12 if shared else -0.12, 0.0, 0.0]
    sequence = []
    for i, ref in enumerate(refs):
        sequence.append(("reference", SPACE.base, ref))
        if i < len(refs) - 1:
            sequence.append(("candidate", cand, 0.02 + (0.12 if shared and i in (2, 3) else 0.0)))
    _blocks(driver, sequence)
    assert driver.disturbed_references() == 1
    iv = driver.interval_of(cand)
    assert iv.gain == pytest.approx(math.exp(0.02))
    assert iv.n == 3  # the two blocks next to it are out


def test_a_finalist_next_to_a_disturbed_reference_gets_another_round():
    """The reference closing a re-measurement round reads 15 % slow: that round tells nothing about the
    finalist, so the search measures it again instead of keeping the default for want of a pair."""
    driver = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan())
    cand = SPACE.base.replace(fusion_threshold_bytes=1 * MiB)
    _blocks(driver, [("reference", SPACE.base, 0.0)] * 5 + [("candidate", cand, 0.02), ("reference", SPACE.base, -0.15)])
    driver.phase, driver._finalists, driver._round = "remeasure", [cand], 1
    assert driver.disturbed_references() == 1 and driver.interval_of(cand) is None
    assert driver._after_round() == (cand, "remeasure", "candidate")
    assert driver.phase == "remeasure" and not driver.decisions and driver._round == 2


def test_a_later_re_measurement_of_a_search_must_clear_a_stricter_interval():
    """A finalist re-measured in two rounds whose 90 % interval clears 1.01x and whose 95 % one does
    not: the search's first re-measurement locks it, with the 90 % interval; its second (the search
    failed one and explored on) keeps going, since it decides at 95 %."""
    cand = SPACE.base.replace(fusion_threshold_bytes=1 * MiB)
    outcome = {}
    for stints in (1, 2):
        driver = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan())
        _blocks(driver, [("reference", SPACE.base, 0.0), ("candidate", cand, 0.04), ("reference", SPACE.base, 0.005),
                         ("candidate", cand, 0.035), ("reference", SPACE.base, -0.005)], spread=0.02)
        assert driver.interval_of(cand, confidence=0.9).low > 1.01 > driver.interval_of(cand, confidence=0.95).low
        driver.phase, driver._finalists, driver._round, driver._remeasures = "remeasure", [cand], 2, stints
        outcome[stints] = driver._after_round()
        if stints == 1:
            assert driver.decisions[-1].knobs == cand and driver.decisions[-1].interval == driver.interval_of(cand)
    assert outcome[1] == (cand, "locked", "locked")
    assert outcome[2] == (cand, "remeasure", "candidate") and not driver.decisions


def test_a_reference_within_reach_of_its_own_step_noise_is_not_set_aside():
    """Steps that vary by 6 % make a 3-step block vary by 3.5 %: a reference 6 % off the others is
    ordinary there, however closely the other four agree; 30 % off it is not."""
    for off, aside in ((0.06, 0), (0.30, 1)):
        driver = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan())
        _blocks(driver, [("reference", SPACE.base, x) for x in (0.0, 0.001, off, 0.0, 0.002)], spread=0.06)
        assert driver.disturbed_references() == aside


def test_the_one_shot_switch_is_searched_only_for_gpu_jobs():
    from tunelab.tuning.space import search_space

    assert "oneshot_max_bytes" not in search_space({}, 1).names
    space = search_space({}, 1, device=True)
    assert "oneshot_max_bytes" in space.names
    low = space.from_unit([0.0] * len(space.names))
    assert low.oneshot_max_bytes == 0  # the lowest bin: always two-shot
    high = space.from_unit([1.0] * len(space.names))
    assert high.oneshot_max_bytes == 16 << 20
    assert "oneshot_max_bytes" not in search_space({"oneshot_max_bytes": 4096}, 1, device=True).names


# ---- retune for a job that loaded its profile ---------------------------------------------------------
def watch_run(land, later, switch_s, seed, steps=1500, writer=None, interval=None, plan=None, host=None):
    """A job that loaded PEAK, watched for ``steps`` steps of ``land`` (``later`` from ``switch_s`` on);
    ``host(t)``: a factor on every step's time from the host (all configurations alike)."""
    from tunelab.tuning.watch import ProfileWatch

    coord, now, lines = FakeCoordinator(), [0.0], []
    obj = Objective(land, seed, Drift(0.03, 60.0, seed), later, switch_s)
    coord.knobs = PEAK
    watch = ProfileWatch(coord, SPACE, PEAK, clock=lambda: now[0], say=lines.append, seed=seed, writer=writer,
                         interval=interval, plan=plan)
    for _ in range(steps):
        now[0] += obj.step_s(coord.knobs) * (host(obj.t_s) if host is not None else 1.0)
        watch.step_done()
    return watch, coord, lines


def test_a_watched_steps_time_holds_neither_the_decision_nor_the_stores_writes():
    """Steps of exactly 0.1 s and a store whose every write takes 0.5 s: the loaded configuration's
    watched blocks score 10 steps/s each (the writes once landed in the next measured step: 8.4)."""
    from tunelab.tuning.watch import ProfileWatch

    now = [0.0]

    class _SlowWriter:
        broken = False

        def sample(self, sample):
            now[0] += 0.5

        def lock(self, driver, last):
            now[0] += 0.5
            return ""

    coord = FakeCoordinator()
    coord.knobs = PEAK
    watch = ProfileWatch(coord, SPACE, PEAK, clock=lambda: now[0], say=lambda line: None, writer=_SlowWriter())
    for _ in range(200):
        now[0] += 0.1
        watch.step_done()
    scores = [round(s.score, 9) for s in watch.driver.samples]
    assert len(scores) >= 5 and scores == [10.0] * len(scores)


def test_a_loaded_profile_is_watched_and_retuned_when_the_optimum_moves():
    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.02, seed=7)
    moved = PEAK.replace(fusion_threshold_bytes=0, cycle_time_ms=64.0)
    later = synthetic("after", SPACE, GRID, lambda k: peaked(moved, 0.4)(k) * (2.0 - peaked(PEAK)(k)),
                      noise=0.02, seed=8)
    for seed in range(2):
        for claimed in (None, CLAIMED):  # unchecked (no gain known), and checked against the profile's claim
            watch, coord, lines = watch_run(first, later, 60.0, seed, interval=claimed)
            d = watch.driver
            assert d.decisions[0].knobs == PEAK and d.epoch >= 1 and len(d.decisions) >= 2, seed
            assert later.true_score(d.decisions[-1].knobs) > later.true_score(PEAK), seed
            assert coord.knobs == d.knobs and any("re-opening" in line for line in lines)
            assert d.phase != "locked" or coord.knobs == d.decisions[-1].knobs
            assert claimed is None or any(c.moved for c in d.checks), seed  # checked first, and found moved
    steady, coord, lines = watch_run(first, None, math.inf, 0)
    assert steady.driver.epoch == 0 and coord.changes == [] and not lines  # nothing moved: nothing changes


def test_an_error_in_a_reopened_search_puts_the_last_lock_back_and_the_checks_blocks_are_stored():
    """The watch failed while its re-opened search measured a candidate (its strategy raised): the job
    trained on for good with that candidate.  The last lock is now asked for again before the error goes
    on (the runtime then ends the watch).  And the first re-open's check blocks, which say why it
    re-opened, reach the store as the later ones' do (those of the first watch period were dropped)."""
    from tunelab.tuning.watch import ProfileWatch

    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.02, seed=7)
    moved = PEAK.replace(fusion_threshold_bytes=0, cycle_time_ms=64.0)
    later = synthetic("after", SPACE, GRID, lambda k: peaked(moved, 0.4)(k) * (2.0 - peaked(PEAK)(k)),
                      noise=0.02, seed=8)

    from tunelab.tuning.watch import StoreWriter

    class _Store:  # what the store is handed
        def __init__(self):
            self.phases = []

        def record_trial(self, *args):
            self.phases.append(args[-1])

        def set_best(self, *args, **kwargs):
            pass

    stored = _Store()
    writer = StoreWriter(stored, 1, "retune-test", say=lambda line: None)
    coord, now = FakeCoordinator(), [0.0]
    obj = Objective(first, 0, Drift(0.03, 60.0, 0), later, 60.0)
    coord.knobs = PEAK
    watch = ProfileWatch(coord, SPACE, PEAK, clock=lambda: now[0], say=lambda line: None, seed=0,
                         writer=writer, interval=CLAIMED)
    error = None
    for _ in range(3000):
        now[0] += obj.step_s(coord.knobs)
        d = watch.driver
        if d.epoch == 1 and d.tuning and coord.knobs not in (SPACE.base, PEAK):  # measuring a candidate
            def failing(*args, **kwargs):
                raise RuntimeError("injected: the strategy failed")

            d.strategy.tell = failing
        try:
            watch.step_done()
        except RuntimeError as exc:
            error = exc
            break
    assert error is not None, "the search never measured a candidate"
    assert coord.knobs == PEAK == watch.driver.locked  # the last lock, not the candidate
    assert "check" in stored.phases


# what PEAK's profile says it gains over the default (peaked: 1.3 on PEAK, 1.059 at the default)
CLAIMED = stats.Interval(1.23, 1.18, 1.28, 6)


def test_a_host_that_moves_is_checked_and_the_search_stays_closed():
    """Every configuration 12 % slower from 60 s on (another job on the host): the watch sees the loaded
    configuration's steps leave their interval, and the check, PEAK between two default blocks, finds
    it still ahead by what its profile claims.  So no search re-opens; without the check (or without a
    claimed gain to hold it to) one does, for nothing."""
    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.02, seed=7)
    host = lambda t: 1.12 if t >= 60.0 else 1.0
    for seed in range(3):
        watch, coord, lines = watch_run(first, None, math.inf, seed, steps=600, interval=CLAIMED, host=host)
        d = watch.driver
        assert d.checks and not any(c.moved for c in d.checks), seed
        assert d.epoch == 0 and len(d.decisions) == 1 and d.checks[0].ratio == pytest.approx(1.228, abs=0.05)
        assert any("the host moved, not the optimum" in line for line in lines)
        assert not any("re-opening" in line for line in lines)
        # the check's blocks ran, and the loaded knobs are back
        assert SPACE.base in coord.changes and coord.knobs == d.knobs and (d.phase != "locked" or d.knobs == PEAK)
        unchecked = watch_run(first, None, math.inf, seed, steps=600, interval=None, host=host)[0].driver
        assert unchecked.epoch >= 1 and not [c for c in unchecked.checks if c.index < unchecked.samples[-1].index
                                             and unchecked.samples[c.index].epoch == 0], seed
        nocheck = watch_run(first, None, math.inf, seed, steps=600, interval=CLAIMED, host=host,
                            plan=Plan(retune=True, check_z=None))[0].driver
        assert nocheck.epoch >= 1 and not nocheck.checks, seed


def test_the_watch_follows_a_host_that_drifts_slowly():
    """The host slows steadily, 20 % over 150 s, on quiet steps (1 % noise between blocks of 3): the
    watched interval follows the line of the blocks, so checks are rare (3 in the six seeds' 2400 or
    so blocks today), each passes, and no search re-opens.  Centred on the window's mean instead of
    its line, the blocks lag behind the host by half a window and leave the interval (18 checks)."""
    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.005, seed=7)
    host = lambda t: math.exp(0.2 * min(t, 150.0) / 150.0)
    checks = 0
    for seed in range(6):
        watch, _, lines = watch_run(first, None, math.inf, seed, steps=1200, interval=CLAIMED, host=host)
        d = watch.driver
        watched = [s.log_score for s in d.samples if s.role == "locked"]
        assert watched[0] - min(watched) > 0.15  # the host did slow (the replay's own drift is 3 %)
        assert not any(c.moved for c in d.checks) and d.epoch == 0, seed
        assert len(watched) > 300 and not any("re-opening" in line for line in lines)
        checks += len(d.checks)
    assert checks <= 6


def test_a_retune_writes_its_trials_and_its_new_lock_back_to_the_profile_store(tmp_path):
    """The next job loads what a retune found: the relocked knobs become the profile's best (with the
    interval and outcome), and its blocks are trials that a later search warms up from.  A store that
    fails is said once, and the job trains on."""
    from tunelab.profiles import ProfileKey, ProfileStore
    from tunelab.tuning.result import stored_observations
    from tunelab.tuning.watch import StoreWriter

    store = ProfileStore(tmp_path / "profiles.db")
    key = ProfileKey("hw", "sig", "torch", 2)
    pid = store.upsert_profile(key, "host", {}, "model")
    store.set_best(pid, PEAK.as_dict(), 12.0, 10.0, 0.01, "tune-run", gain_interval=(1.2, 1.1, 1.3))
    first = synthetic("before", SPACE, GRID, peaked(PEAK), noise=0.02, seed=7)
    moved = PEAK.replace(fusion_threshold_bytes=0, cycle_time_ms=64.0)
    later = synthetic("after", SPACE, GRID, lambda k: peaked(moved, 0.4)(k) * (2.0 - peaked(PEAK)(k)),
                      noise=0.02, seed=8)
    said: list[str] = []
    watch, coord, lines = watch_run(first, later, 60.0, 1, writer=StoreWriter(store, pid, "retune-1", said.append))
    d = watch.driver
    relocked = d.decisions[-1]
    assert relocked.epoch >= 1 and relocked.adopted and relocked.knobs != PEAK
    best = store.best(key)
    assert Knobs(**best.knobs) == relocked.knobs and best.outcome.startswith("retuned")
    # each search under its own run id (the job's run id, .r1 for the first retune, ...): the best names
    # the one that set it
    assert best.gain_low == pytest.approx(relocked.interval.low) and best.run_id == f"retune-1.r{relocked.epoch}"
    assert best.gain == pytest.approx(later.true_score(relocked.knobs) / later.true_score(SPACE.base), rel=0.1)
    for epoch in range(1, d.epoch + 1):
        mine = [t for t in store.trials(pid) if t.run_id == f"retune-1.r{epoch}"]
        measured = [s for s in d.samples if s.epoch == epoch and s.role != "locked"]
        assert len(mine) == len(measured) and {t.phase for t in mine} >= {"default", "explore"}
    assert len(stored_observations(store.trials(pid), 0.1)) >= 3  # what the next search warms up from
    assert any("saved to profile" in line for line in lines) and not said
    # a retune that keeps the default says so in the store: the next job loads the default knobs (after
    # the move every configuration but the default is slower than the default)
    flat = synthetic("after", SPACE, GRID, lambda k: 1.0 if k == SPACE.base else 0.85, noise=0.02, seed=8)
    watch, coord, lines = watch_run(first, flat, 60.0, 0, writer=StoreWriter(store, pid, "retune-2", said.append),
                                    interval=CLAIMED)
    assert watch.driver.checks[0].moved and not watch.driver.decisions[-1].adopted
    best = store.best(key)
    assert Knobs(**best.knobs) == SPACE.base and best.outcome.endswith("default kept") and best.gain_low is None

    class Broken:
        def record_trial(self, *a, **k):
            raise OSError("disk full")

        set_best = record_trial

    said: list[str] = []
    watch, coord, lines = watch_run(first, later, 60.0, 0, writer=StoreWriter(Broken(), pid, "r", said.append))
    assert len(watch.driver.decisions) >= 2 and coord.knobs == watch.driver.decisions[-1].knobs  # trained on
    assert len(said) == 1 and "disk full" in said[0]


def test_the_retune_setting_is_read_from_the_environment_and_arguments():
    from tunelab.config import load_engine_config

    assert not load_engine_config({}).retune
    assert load_engine_config({"TUNELAB_RETUNE": "1"}).retune
    assert load_engine_config({"TUNELAB_RETUNE": "on"}, retune=False).retune is False  # explicit wins
    with pytest.raises(ValueError, match="retune"):
        load_engine_config({"TUNELAB_RETUNE": "maybe"})


def test_the_block_noise_bound_is_the_chi_square_limit_of_the_references_differences():
    """Three references whose means differ by +3 % and -1 %, each of 3 steps at a 2 % step noise: the
    mean square successive difference / 2 is 0.00025 over 2 differences; at 95 % its upper limit is
    0.00025 * 2 / chi2.ppf(0.05, 2), less the steps' share (0.0004 / 3)."""
    from scipy.stats import chi2

    def block(mean):
        return [mean - 0.02, mean, mean + 0.02]  # step variance 0.0004

    refs = [block(0.0), block(0.03), block(0.02)]
    model = noise.estimate([("ref", b) for b in refs], "ref", refs)
    step = model.step_var["ref"]
    ms = (0.03 ** 2 + 0.01 ** 2) / 2 / 2
    bound = model.bounded(0.05)
    assert bound.tau2 == pytest.approx(ms * 2 / chi2.ppf(0.05, 2) - step / 3)
    assert bound.tau2 > 10 * model.tau2 and bound.df_tau > 1000
    one = noise.estimate([("ref", refs[0])], "ref", refs[:1])
    assert one.bounded(0.05) == one  # no difference yet: nothing to bound


@pytest.mark.xfail(strict=True, reason=(
    "known defect (2026-11-28): on this host 3 of 80 seeds lock from exploration and all 3 miss; "
    "re-measurement locks miss too (12 of 14): in all, 15 of the 80 seeds lock a low end above the truth, "
    "where a 95 % bound allows 4.  Not the replay's few states alone (near-Gaussian states, 200 visits a "
    "point: 15 of 17; there, filter off and no noise prior: 12 of 13, here 5 of 7); one round's interval "
    "holds in 86 % of forks (92 % without the 1 % noise prior), and a run looks 2.5 times on average, "
    "locking at the first look that clears: docs/tuning.md, 2026-11-28"))
def test_a_lock_straight_from_exploration_holds_its_low_end_on_a_host_whose_state_moves():
    """A host whose state moves by 8 % from one visit to the next (3-step blocks), one point 4 % faster:
    a lock straight from exploration rests on two or three references' differences, which often agree
    far more closely than that by chance; with the block-level noise at its upper confidence limit no
    such lock should claim a gain its truth does not reach (with the plain estimate, 3 of these 80 seeds
    did).  Both of its reasons are locks from exploration: the pick's own blocks, and the stand-in's
    ("the best explored configuration's blocks"), which the check once left out."""
    land = synthetic("moving-host", SPACE, GRID, lambda k: 1.04 if k.fusion_threshold_bytes == 0 else 1.0,
                     noise=0.02, seed=3, visits=8, visit_noise=0.08)
    assert land.visit_sigma > 0.05
    missed = []
    for seed in range(80):
        driver = Driver(SPACE, lambda e, s=seed: make_strategy("tunelab", SPACE, s + 1000 * e), Plan(block_seconds=None))
        d = simulate(driver, Objective(land, seed)).decisions[0]
        if d.adopted and "configurations explored" in d.reason:
            gain = land.true_log_rate(d.knobs) - land.true_log_rate(SPACE.base)
            if gain < math.log(d.interval.low):
                missed.append(seed)
    assert missed == []


def test_given_first_settings_take_the_places_of_the_gps_initial_design():
    """The scale model's first proposals are asked first; for the GP they stand in for the first places of
    its Latin hypercube (the rest of the design follows, then expected improvement as early as without
    them); a strategy without a design (random search) asks its own after them."""
    from tunelab.tuning.strategies import SeededStrategy

    given = [SPACE.from_unit([0.9] * len(SPACE.names)), SPACE.from_unit([0.1] * len(SPACE.names))]
    plain = make_strategy("tunelab", SPACE, 3)
    design = [plain.ask() for _ in range(plain.initial_points)]
    seeded = SeededStrategy(make_strategy("tunelab", SPACE, 3), given)
    asked = [seeded.ask() for _ in range(plain.initial_points)]
    assert asked == given + design[2:]
    own_first = make_strategy("random", SPACE, 3).ask()
    seeded_random = SeededStrategy(make_strategy("random", SPACE, 3), given)
    assert [seeded_random.ask() for _ in range(3)] == [*given, own_first]


def test_a_candidate_beside_a_reference_set_aside_then_kept_is_told_once_it_pairs():
    """The host steps down 10 % at the fifth reference; the references before it look disturbed until
    enough later ones say the new level is the host's: a candidate measured right after a reference set
    aside at the time is told once that reference is kept (it was never told at all)."""
    plan = Plan(block_seconds=None, budget_samples=40, reference_every=3)
    drv = Driver(SPACE, lambda e: make_strategy("random", SPACE, e), plan, 1.0)
    k = 0
    while len(drv.samples) < 29 and drv.tuning:
        b = drv._block
        idx = len(drv.samples)
        level = 0.05 if b is not None and b.role == "candidate" else (0.0 if idx < 12 or b is None else -0.1)
        k += 1
        drv.step_done(math.exp(-level + 0.001 * (-1) ** k))
    kept = {r[0] for r in drv._refs()}
    candidates = [s for s in drv.samples if s.role == "candidate"]
    pairing = [s for s in candidates if not drv._next_to_disturbed(float(s.index), kept)]
    assert pairing, [(s.index, s.role) for s in drv.samples]
    # every candidate that pairs with kept references now is told, with a finite variance
    live = {o.knobs for o in drv.strategy.live}
    assert all(s.index in drv._told_at and s.told is not None and s.knobs in live for s in pairing), \
        [(s.index, s.index in drv._told_at, s.told) for s in pairing]


def test_bad_step_times_and_plans_are_refused():
    drv = Driver(SPACE, lambda e: make_strategy("tunelab", SPACE, e), Plan(block_seconds=None), 1.0)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="a step's time must be a positive number"):
            drv.step_done(bad)
    assert drv.steps == 0
    for kwargs in ({"reference_every": 0}, {"confidence": 1.0}, {"confidence": 0.0}):
        with pytest.raises(ValueError, match="tuning plan"):
            Plan(**kwargs)
    with pytest.raises(ValueError, match="fusion_threshold_bytes must be a number"):
        Knobs(fusion_threshold_bytes=math.inf)


def test_stored_trials_that_varied_a_knob_now_pinned_are_left_out_of_a_warm_start():
    from types import SimpleNamespace

    from tunelab.tuning.result import stored_observations

    base = Knobs(segment_bytes=4 * MiB)

    def trial(phase, score, **knobs):
        return SimpleNamespace(run_id="r1", phase=phase, score=score, knobs=base.replace(**knobs).as_dict())

    trials = [trial("default", 10.0), trial("default", 10.2), trial("explore", 12.0, segment_bytes=64 << 10),
              trial("explore", 11.0, fusion_threshold_bytes=8 * MiB)]
    everything = stored_observations(trials, 0.1, base)
    assert len(everything) == 2
    kept = stored_observations(trials, 0.1, base, searched=["fusion_threshold_bytes", "cycle_time_ms"])
    assert [o.knobs.fusion_threshold_bytes for o in kept] == [8 * MiB]
    assert math.isclose(kept[0].value, math.log(11.0) - math.log(10.1))


def test_a_retune_reads_a_steps_samples_from_the_profiles_own_trials():
    """A job's retune times steps and knows no batch: the samples a step held are read back from the
    profile's trials (score x seconds / steps, a geometric mean rate times a mean step time), so what it
    stores is samples/s as tune stored them.  Retune runs' trials (stored as steps/s before) do not
    count; no trial that tells gives None."""
    from types import SimpleNamespace

    from tunelab.tuning.result import samples_per_step

    rng = np.random.default_rng(3)
    trials = []
    for i in range(12):  # 64 samples a step, blocks of 10 steps with 3 % noise
        times = 0.1 * np.exp(rng.normal(0, 0.03, 10))
        score = float(np.exp(np.mean(np.log(64 / times))))
        trials.append(SimpleNamespace(run_id="run-a", score=score, seconds=float(times.sum()), steps=10))
    trials.append(SimpleNamespace(run_id="retune-1a2b3c4d", score=10.0, seconds=1.0, steps=10))  # steps/s
    trials.append(SimpleNamespace(run_id="run-b", score=0.0, seconds=1.0, steps=0))  # tells nothing
    assert samples_per_step(trials) == 64.0
    assert samples_per_step(trials[-2:]) is None
    assert samples_per_step([]) is None


def test_a_stored_claim_holds_only_where_the_job_runs_its_knobs_against_its_default():
    """A profile's claimed gain is what a check holds the loaded knobs to: not where the job pins one of
    them otherwise, and not where the claim was measured against another default (a profile tuned
    before the cycle default became 10 ms claimed its gain over 1 ms)."""
    from types import SimpleNamespace

    from tunelab.tuning.watch import stored_claim

    base = SPACE.base
    best = SimpleNamespace(knobs={"cycle_time_ms": 16.0}, gain=1.2, gain_low=1.1, gain_high=1.3, run_id="r")
    loaded = base.replace(cycle_time_ms=16.0)

    def default_trial(knobs, run_id="r"):
        return SimpleNamespace(knobs=knobs.as_dict(), run_id=run_id, phase="default")

    claim = stored_claim(best, [default_trial(base)], loaded, base)
    assert claim is not None and (claim.gain, claim.low, claim.high) == (1.2, 1.1, 1.3)
    assert stored_claim(best, [default_trial(base)], loaded.replace(cycle_time_ms=8.0), base) is None  # pinned
    other = base.replace(cycle_time_ms=base.cycle_time_ms * 10)
    assert stored_claim(best, [default_trial(other)], loaded, base) is None  # another default
    assert stored_claim(best, [default_trial(other, "older run")], loaded, base) is not None  # another run's
    assert stored_claim(SimpleNamespace(**{**vars(best), "gain_low": None}), [], loaded, base) is None
