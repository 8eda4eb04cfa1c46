"""The scale model on lab runs shipped with tunelab (``tunelab/model/runs``: ``bench allreduce --lab`` on
2 x 1, 2 x 2, 2 x 4, 4 x 1 and 4 x 2 hosts x ranks behind 1 Gb/s links, twice each; 2 x 1 and one host of 2
at small sizes for their latencies, by route; segment sizes other than the sweeps' 4 MiB; a replayed training job's step
times; all recorded with today's engine on this 2-core host): fitted on some sizes and layouts, it
predicts the measured times it did not see.  The measurements are the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunelab.cli import main

RUNS = Path(__file__).resolve().parent.parent / "tunelab" / "model" / "runs"
SWEEPS = [RUNS / f"sweep-H{h}-K{k}-G1{r}.json" for h, k in ((2, 1), (2, 2), (2, 4), (4, 1)) for r in ("", ".r2")]
# a core per rank at 1-16 KiB, 50 iterations: the sweeps from 64 KiB are the wire's, so latencies with a
# core per rank (what a prediction for real hosts uses) are measured here, by route: 2 x 1 with the short
# route (recursive doubling) and with the ring (the general path), one host of 2 ranks with the short
# route (the agreed one-shot) and with the two-shot (the general path)
LATENCY = [RUNS / f"lat-{name}{r}.json" for name in ("H2-K1-G1", "H2-K1-G1-ring", "H1-K2", "H1-K2-twoshot")
           for r in ("", ".r2", ".r3")]
FIT = SWEEPS + LATENCY
FIT_SIZES = "1KiB,4KiB,16KiB,64KiB,1MiB,16MiB,256MiB"
OLD_FIT = [p for p in SWEEPS if "H2-K4" not in p.name]  # the layouts fitted before 2 x 4 was recorded
OTHER_HOSTS = [RUNS / f"sweep-H4-K2-G1{r}.json" for r in ("", ".r2")]
SEGMENTS_4X2 = [RUNS / f"knob-H4-K2-G1-seg256k{r}.json" for r in ("", ".r2", ".r3", ".r4", ".r5")]
SEGMENTS_2X2 = {seg: [RUNS / f"knob-H2-K2-G1-seg{seg}{r}.json" for r in ("", ".r2")] for seg in ("256k", "1m")}
SEGMENTS_2X4 = [RUNS / f"knob-H2-K4-G1-seg256k{r}.json" for r in ("", ".r2")]
LANDSCAPES = [RUNS / f"landscape-lab-H2-K2-G1{r}.json" for r in ("", ".r2", ".r3")]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "model.json"
    assert main(["model", "fit", *map(str, FIT), "--sizes", FIT_SIZES, "--out", str(out)]) == 0
    return out


def _check(model_file: Path, tmp_path: Path, files: list[Path], sizes: str | None = None) -> dict:
    """``model predict --check``: the topology predicted does not matter to the check, which predicts each
    file at its own layout."""
    out = tmp_path / "check.json"
    argv = ["model", "predict", "--model-file", str(model_file), "--hosts", "4", "--ranks-per-host", "2",
            "--link-gbps", "1", "--no-report", "--json", str(out), "--check", *map(str, files)]
    assert main(argv + (["--check-sizes", sizes] if sizes else [])) == 0
    return json.loads(out.read_text())["check"]


def test_the_shipped_runs_are_what_the_readme_says() -> None:
    for path in SWEEPS + OTHER_HOSTS:
        doc = json.loads(path.read_text())
        lab = doc["hardware"]["lab"]
        assert lab["link_gbps"] == 1.0 and f"H{lab['hosts']}-K{lab['ranks_per_host']}" in path.name
        assert {r["algorithm"] for r in doc["rows"]} >= {"ring", "hierarchical", "mpi"}
        assert all(r["wrong"] == 0 for r in doc["rows"] if r["algorithm"] != "link-bound")


def test_held_out_sizes_behind_the_link_are_predicted_within_15_percent(model_file: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """256 KiB, 4 MiB and 64 MiB of the fitted layouts, not fitted: from 1 MiB 23 of 24 within 15 %, the
    other (MPI at 64 MiB on 2 x 4, under by 15.1 %) within 16 %."""
    check = _check(model_file, tmp_path, SWEEPS, "256KiB,4MiB,64MiB")
    capsys.readouterr()
    points = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(points) == 24 and all(p["held_out"] for p in points)
    errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in points]
    assert sum(abs(p["rel_error"]) <= 0.15 for p in points) >= 23, errors
    assert all(abs(p["rel_error"]) <= 0.16 for p in points), errors


def test_another_host_count_at_the_same_oversubscription(model_file: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """4 x 2: 8 ranks on 2 cores, as 2 x 4 in the fit, on twice the hosts.  From 1 MiB the engine's
    hierarchical path and MPI within 15 %; the flat ring within 15 % from 16 MiB, under-predicted by
    18-19 % at 1 and 4 MiB (its 14 ring steps each wait for a rank to get a core back, on a machine
    where 4 share one).  Model and measurement name the same winner of flat and hierarchical at every
    size: hierarchical."""
    check = _check(model_file, tmp_path, OTHER_HOSTS)
    capsys.readouterr()
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(big) == 15
    steady = [p for p in big if p["algorithm"] != "flat" or p["size"] >= 16 << 20]
    assert all(abs(p["rel_error"]) <= 0.15 for p in steady), [(p["algorithm"], p["size"], round(p["rel_error"], 3))
                                                              for p in steady]
    assert all(abs(p["rel_error"]) <= 0.25 for p in big if p not in steady)
    [cross] = [c for c in check["crossover"] if "H4-K2" in json.dumps(c)]
    assert cross["winners_agree"] == cross["sizes"] == 7, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("no crossover: hierarchical is faster"), cross


def test_a_shaped_links_wire_is_fitted_no_faster_than_its_rate(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Fitted on the layouts of at most 2 ranks a core, the fit could explain the runs as well with a
    1 Gb/s wire at 1.4 Gb/s and TCP's CPU cost making up the rest; the link's rate bounds it below."""
    out = tmp_path / "model.json"
    assert main(["model", "fit", *map(str, OLD_FIT), "--sizes", "64KiB,1MiB,16MiB,256MiB", "--out", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["values"]["link:1gbps.beta"] >= 8e-9


def test_the_step_time_of_a_lab_landscape(model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The ResNet-50 replay trained on 2 x 2 lab hosts behind 1 Gb/s (``bench landscape --lab``, fusion
    0 / 8 / 64 MiB x hierarchical off / on, 3 runs of 2 visits): the model, fitted on allreduces alone,
    predicts each setting's step time within 15 %, and orders hierarchical ahead of flat at every fusion."""
    out = tmp_path / "steps.json"
    argv = ["model", "predict", "--model-file", str(model_file), "--hosts", "2", "--ranks-per-host", "2",
            "--link-gbps", "1", "--oversubscription", "2", "--scenario", "replay-resnet50-lab", "--no-report",
            "--json", str(out), "--check-steps", *map(str, LANDSCAPES)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # knobs as every command prints them: no fusion is "off", hierarchical on/off (not 0B, True/False)
    check_table = printed.split("# step check:")[1]
    assert "   off " in check_table and " on " in check_table and "True" not in printed and " 0B " not in printed
    assert "# best: fusion " in printed and ", hierarchical on" in printed
    points = json.loads(out.read_text())["check_steps"]
    assert len(points) == 6 and all(abs(p["rel_error"]) <= 0.15 for p in points), points
    for fusion in {p["knobs"]["fusion_threshold_bytes"] for p in points}:
        pair = {p["knobs"]["hierarchical"]: p for p in points if p["knobs"]["fusion_threshold_bytes"] == fusion}
        assert pair[True]["measured_s"] < pair[False]["measured_s"]
        assert pair[True]["predicted_s"] < pair[False]["predicted_s"]


def test_a_crossover_the_segment_knob_shows_on_a_fitted_layout(model_file: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """2 x 2 with 256 KiB and 1 MiB pieces (held out: another knob; two runs each, 11 sizes from 16 KiB to
    16 MiB).  Small buffers take the flat path's recursive doubling (up to 32 KiB) or a ring of few
    steps, while hierarchical pays two ordering points of 4 ranks on 2 cores: flat is faster below a
    crossover, hierarchical above it.  Measured (the median over runs) at 80 and 61 KiB, predicted at
    52 KiB for both: factors 0.66 and 0.86, within the issue's 2; the same winner at all 11 sizes.  From
    1 MiB every point is within 15 %, hierarchical with 256 KiB pieces within 5 % (over-predicted by
    17-20 % while every ordering point of a piece paid a wake-up: ``costs.shm_wakes``)."""
    for files, factor in ((SEGMENTS_2X2["256k"], 0.65), (SEGMENTS_2X2["1m"], 0.85)):
        check = _check(model_file, tmp_path, files)
        capsys.readouterr()
        [cross] = check["crossover"]
        assert cross["repeats"] == 2 and cross["winners_agree"] == cross["sizes"] == 11, cross
        for side in ("measured", "predicted"):
            assert cross[side].startswith("crossover at") and "flat below, hierarchical above" in cross[side], cross
        assert 0.5 <= cross["factor"] <= 2.0 and cross["factor"] >= factor - 0.01, cross
        big = [p for p in check["points"] if p["size"] >= 1 << 20]
        errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in big]
        assert len(big) == 15 and all(abs(p["rel_error"]) <= 0.15 for p in big), errors
        assert all(abs(p["rel_error"]) <= 0.06 for p in big if p["algorithm"] == "hierarchical"), errors


def test_small_segments_on_8_ranks(model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """256 KiB pieces with 8 ranks on 2 cores, held out twice (another knob; 4 x 2 another host count).
    On 4 x 2 (five runs, 12 sizes from 64 KiB to 16 MiB) each piece's ordering points and ring steps wait
    for cores, and from a few pieces on the flat ring overtakes hierarchical: model and measurement name
    a crossover the same way round, but measured at 2.35 MiB and predicted at 406 KiB (a factor of 0.17:
    the model charges the flat ring too little there), the same winner at all 12 sizes.  The five runs
    on their own cross at 1.11-3.10 MiB, four of them within a factor of 2 of the median's 2.35 MiB.
    From 1 MiB MPI is within 10 %, hierarchical within 10 % (over by 13-23 % while every ordering point
    of a piece paid a wake-up: ``costs.shm_wakes``), flat under by 2-21 %.  On 2 x 4 (two runs, 7 sizes)
    hierarchical wins at every size, measured and predicted; it is over-predicted by 14-32 % (22-56 %
    before), flat and MPI within 16 % from 1 MiB."""
    check = _check(model_file, tmp_path, SEGMENTS_4X2)
    capsys.readouterr()
    [cross] = check["crossover"]
    assert cross["repeats"] == 5 and cross["sizes"] == cross["winners_agree"] == 12, cross
    own = sorted(cross["repeat_crossovers"])
    assert cross["repeats_within_2x"] == 4 and 1.0 < own[0] / (1 << 20) < 1.2 and 3.0 < own[-1] / (1 << 20) < 3.2, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("crossover at") and "hierarchical below, flat above" in cross[side], cross
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in big]
    assert len(big) == 21 and all(abs(p["rel_error"]) <= 0.10 for p in big if p["algorithm"] == "mpi"), errors
    assert all(abs(p["rel_error"]) <= 0.10 for p in big if p["algorithm"] == "hierarchical"), errors
    assert all(abs(p["rel_error"]) < 0.25 for p in big if p["algorithm"] == "flat"), errors
    check = _check(model_file, tmp_path, SEGMENTS_2X4)
    capsys.readouterr()
    [cross] = check["crossover"]
    assert cross["winners_agree"] == cross["sizes"] == 7, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("no crossover: hierarchical is faster"), cross
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert all(abs(p["rel_error"]) <= 0.16 for p in big if p["algorithm"] != "hierarchical"), big
    assert all(abs(p["rel_error"]) < 0.35 for p in check["points"] if p["algorithm"] == "hierarchical"), big


def test_small_calls_with_a_core_per_rank_by_route(model_file: Path) -> None:
    """The latency runs (in the fit): the engine's four routes at 1 and 4 KiB (2 x 1: recursive doubling
    27-31 us, the ring 90-98 us; one host: the agreed one-shot 4.5-5 us, the two-shot 45 us) within 7 %,
    and MPI_Allreduce at 1 KiB within 10 % (at 4 KiB on 2 x 1 it measured 28 us, less than the 33 us
    the link's nominal rate gives its 4 KiB each way, which no form of the model reaches)."""
    points = [p for p in json.loads(model_file.read_text())["fit_points"]
              if "lat-" in p["source"] and p["size"] <= 4096]
    assert len(points) == 20
    engine = [p for p in points if p["algorithm"] != "mpi"]
    assert all(abs(p["rel_error"]) <= 0.07 for p in engine), engine
    assert all(abs(p["rel_error"]) <= 0.10 for p in points if p["algorithm"] == "mpi" and p["size"] == 1024), points


def test_the_crossover_for_single_tensors_and_for_fused_buckets(model_file: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """On 4 x 2 a single small tensor takes the flat path's short route (recursive doubling, no planning),
    so flat wins below about 1 KiB; a training job's fused buckets never do, and for them hierarchical
    wins at every size: ``predict`` names both."""
    out = tmp_path / "p.json"
    assert main(["model", "predict", "--model-file", str(model_file), "--hosts", "4", "--ranks-per-host", "2",
                 "--link-gbps", "1", "--no-report", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    cross = json.loads(out.read_text())["crossover"]
    assert cross["faster_below"] == "flat" and cross["faster_above"] == "hierarchical" and len(cross["sizes"]) == 1
    assert cross["buckets"]["sizes"] == [] and cross["buckets"]["faster_below"] == "hierarchical"
    assert "for a training job's fused buckets (no short route): no crossover: hierarchical" in text
