"""bench tuner: the nearest-point objective, the strategies' protocols, samples-to-5 %, the CLI on a
shipped landscape; and the grid helpers of bench landscape."""

import json
import subprocess
import sys

import pytest

from tunelab.bench.landscape import DEFAULT_GRID, grid_points, grid_space, parse_grid, visit_order
from tunelab.bench.tuner import (
    HOROVOD_STARTS,
    LANDSCAPE_DIR,
    RUNNERS,
    Landscape,
    Objective,
    best_so_far,
    samples_to_reach,
)
from tunelab.knobs import Knobs, MiB

pytest.importorskip("skopt")

NAMES = ["fusion_threshold_bytes", "cycle_time_ms"]


def landscape(points, names=NAMES):
    """A handmade landscape: points are (knob changes, visit scores)."""
    doc = {"space": {"names": names, "base": Knobs().as_dict()},
           "points": [{"knobs": Knobs().replace(**k).as_dict(), "scores": s} for k, s in points]}
    return Landscape.from_dict(doc, "tiny")


def tiny():
    return landscape([({"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0}, [10.0, 12.0]),
                      ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 1.0}, [20.0, 20.0]),
                      ({"fusion_threshold_bytes": 0, "cycle_time_ms": 10.0}, [30.0, 34.0]),
                      ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 10.0}, [40.0, 44.0])])


@pytest.mark.parametrize("knobs,expected", [
    ({"fusion_threshold_bytes": 8 * MiB, "cycle_time_ms": 1.0}, 20.0),    # on a grid point
    ({"fusion_threshold_bytes": 4 * MiB, "cycle_time_ms": 1.0}, 20.0),    # log2 22: nearer 23 than 13 (off)
    ({"fusion_threshold_bytes": 16 << 10, "cycle_time_ms": 10.0}, 32.0),  # log2 14: nearer the "off" bin
    ({"fusion_threshold_bytes": 0, "cycle_time_ms": 3.0}, 11.0),          # log 3 is nearer log 1 than log 10
    ({"fusion_threshold_bytes": 0, "cycle_time_ms": 4.0}, 32.0),          # log 4 is nearer log 10
    ({"fusion_threshold_bytes": 64 * MiB, "cycle_time_ms": 100.0}, 42.0),
])
def test_objective_answers_the_nearest_grid_point_exactly_without_noise(knobs, expected):
    land = tiny()
    measure = Objective(land, seed=0, noise=False)
    assert measure(Knobs().replace(**knobs)) == expected
    assert land.true_score(Knobs().replace(**knobs)) == expected
    assert land.best == 42.0 and measure.calls == 1


def test_objective_noise_is_seeded_and_follows_the_points_spread():
    land = tiny()
    knobs = Knobs(fusion_threshold_bytes=8 * MiB, cycle_time_ms=1.0)  # both visits 20: no spread
    assert Objective(land, seed=1)(knobs) == 20.0
    noisy = Knobs(fusion_threshold_bytes=0, cycle_time_ms=10.0)
    a = [Objective(land, seed=5)(noisy) for _ in range(2)]
    assert a[0] == a[1] != 32.0 and abs(a[0] - 32.0) < 5 * 2 ** 1.5


def test_categorical_knobs_must_match_exactly():
    names = [*NAMES, "hierarchical"]
    land = landscape([({"fusion_threshold_bytes": 8 * MiB, "hierarchical": False}, [5.0]),
                      ({"fusion_threshold_bytes": 0, "hierarchical": True}, [7.0])], names)
    near_false = Knobs(fusion_threshold_bytes=8 * MiB, hierarchical=True)
    assert land.true_score(near_false) == 7.0
    assert land.true_score(near_false.replace(hierarchical=False)) == 5.0


@pytest.mark.parametrize("strategy", sorted(RUNNERS))
def test_strategies_measure_the_default_first_and_respect_the_budget(strategy):
    land = tiny()
    for budget in (1, 7):
        measure = Objective(land, seed=3)
        history = RUNNERS[strategy](land.space, measure, budget, 3)
        assert 1 <= len(history) <= budget and measure.calls == len(history)
        assert history[0][0] == land.space.base


def test_horovod_starts_each_boolean_combination_at_its_four_fixed_points():
    names = [*NAMES, "hierarchical"]
    land = landscape([({"hierarchical": h, "fusion_threshold_bytes": f}, [1.0 + f / MiB + h])
                      for h in (False, True) for f in (0, 8 * MiB)], names)
    history = RUNNERS["horovod"](land.space, Objective(land, seed=0), 50, 0)
    assert len(history) == 1 + 2 * 21
    for start in (1, 22):
        hier = start == 22
        got = [(k.fusion_threshold_bytes, k.cycle_time_ms, k.hierarchical) for k, _ in history[start:start + 4]]
        assert got == [(mib * MiB, ms, hier) for mib, ms in HOROVOD_STARTS]
        assert {k.hierarchical for k, _ in history[start:start + 21]} == {hier}


def test_best_so_far_is_the_true_score_of_the_best_measured_point_and_samples_to_5pct():
    land = tiny()
    a, b, c = (Knobs(fusion_threshold_bytes=f, cycle_time_ms=ms) for f, ms in ((0, 1.0), (8 * MiB, 1.0), (0, 10.0)))
    curve = best_so_far(land, [(a, 11.0), (b, 50.0), (c, 32.0)], budget=5)  # b measured lucky
    assert curve == [11.0, 20.0, 20.0, 20.0, 20.0]
    assert samples_to_reach([10.0, 30.0, 39.0, 40.0, 42.0], 0.95 * 42.0) == 4
    assert samples_to_reach([10.0, 39.8, 39.9], 0.95 * 42.0) == 3  # 39.9 is the 5 % mark
    assert samples_to_reach([10.0, 11.0, 12.0], 0.95 * 42.0) == 4  # never: budget + 1


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


def test_cli_on_the_shipped_resnet50_landscape(tmp_path):
    shipped = LANDSCAPE_DIR / "resnet50-torch-2ranks.json"
    out = tmp_path / "tuner.json"
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "bench", "tuner", "--landscape", str(shipped),
                           "--seeds", "3", "--max-samples", "15", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reports = list((tmp_path / "reports").glob("tuner-*.html"))  # a bench writes its report by default
    assert len(reports) == 1 and f"# report: reports/{reports[0].name}" in proc.stdout
    assert "Tuner quality" in reports[0].read_text() or "tuner" in reports[0].read_text().lower()
    result = json.loads(out.read_text())
    assert [r["strategy"] for r in result["rows"]] == ["tunelab", "random", "horovod"]
    for row in result["rows"]:
        assert {"strategy", "median_samples_to_5pct", "p25", "p75", "reached", "seeds", "landscape"} <= set(row)
        assert row["seeds"] == 3 and 0 <= row["reached"] <= 3 and row["landscape"] == "resnet50-torch-2ranks"
        assert 1 <= row["p25"] <= row["median_samples_to_5pct"] <= row["p75"] <= 16
    assert set(result["curves"]) == {"tunelab", "random", "horovod"}
    for curve in result["curves"].values():
        assert len(curve) == 15 and all(0 < v <= 1.0 + 1e-9 for v in curve)  # fractions of the grid's best
    assert "horovod" in proc.stdout and "median" in proc.stdout


def test_the_shipped_two_node_landscape_searches_hierarchical_jointly():
    land = Landscape.load(LANDSCAPE_DIR / "replay-vgg16-2nodes-10gbps.json")
    assert land.space.names == ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes", "hierarchical")
    assert len(land.knobs) == 48
    assert land.knobs[int(land.means.argmax())].hierarchical  # behind a slow link the node-local stages pay
