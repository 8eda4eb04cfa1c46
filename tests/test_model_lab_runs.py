"""The scale model on lab runs shipped with tunelab (``tunelab/model/runs/<day>``: ``bench allreduce --lab``
on 2 x 1, 2 x 2, 2 x 4, 4 x 1 and 4 x 2 hosts x ranks behind 1 Gb/s links, twice each; 2 x 1 and one host
of 2 at small sizes for their latencies, by route; segment sizes other than the sweeps' 4 MiB; a replayed
training job's step times; all recorded on this 2-core host on one day, 2026-11-27, with the engine of
that day): fitted on some sizes and layouts, it predicts the measured times it did not see.  The
measurements are the reference.  The same set recorded on 2026-11-25 (``runs/2026-11-25``) checks the
model across days."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunelab.cli import main

DAYS = Path(__file__).resolve().parent.parent / "tunelab" / "model" / "runs"
RUNS = DAYS / "2026-11-27"  # one day's full set: what the README's checks fit and check
OTHER_DAY = DAYS / "2026-11-25"
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
SEGMENTS_2X2["64k"] = [RUNS / f"knob-H2-K2-G1-seg64k{r}.json" for r in ("", ".r2", ".r3", ".r4", ".r5")]
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
    """256 KiB, 4 MiB and 64 MiB of the fitted layouts, not fitted: all 36 within 15 % (the largest error
    12 %; on the runs of 2026-11-25, fitted the same way, MPI at 64 MiB on 2 x 4 was under by 15.1 %)."""
    check = _check(model_file, tmp_path, SWEEPS, "256KiB,4MiB,64MiB")
    capsys.readouterr()
    points = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(points) == 24 and all(p["held_out"] for p in points)
    errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in check["points"]]
    assert len(errors) == 36 and all(abs(p["rel_error"]) <= 0.15 for p in check["points"]), errors


def test_another_host_count_at_the_same_oversubscription(model_file: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """4 x 2: 8 ranks on 2 cores, as 2 x 4 in the fit, on twice the hosts.  From 1 MiB the engine's
    hierarchical path within 10 % and MPI within 12 %; the flat ring within 8 % from 16 MiB, under-predicted
    by 21 and 11 % at 1 and 4 MiB (on four hosts a ring step has four transfers through the links at once,
    on 2 x 4 two: the model costs the wait for the slowest of them, not the rest of the gap).  Model and
    measurement name the same winner of flat and hierarchical at every size: hierarchical."""
    check = _check(model_file, tmp_path, OTHER_HOSTS)
    capsys.readouterr()
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(big) == 15
    steady = [p for p in big if p["algorithm"] != "flat" or p["size"] >= 16 << 20]
    assert all(abs(p["rel_error"]) <= 0.15 for p in steady), [(p["algorithm"], p["size"], round(p["rel_error"], 3))
                                                              for p in steady]
    assert all(-0.25 <= p["rel_error"] < -0.1 for p in big if p not in steady)  # under-predicted
    assert all(abs(p["rel_error"]) <= 0.10 for p in big if p["algorithm"] == "hierarchical")
    assert all(abs(p["rel_error"]) <= 0.12 for p in big if p["algorithm"] == "mpi")
    assert all(abs(p["rel_error"]) <= 0.08 for p in big if p["algorithm"] == "flat" and p in steady)
    [cross] = [c for c in check["crossover"] if "H4-K2" in json.dumps(c)]
    assert cross["winners_agree"] == cross["sizes"] == 7, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("no crossover: hierarchical is faster"), cross


def test_a_shaped_links_wire_is_fitted_no_faster_than_its_rate(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Fitted on the layouts of at most 2 ranks a core, the fit could explain the runs as well with a
    1 Gb/s wire faster than its rate and TCP's CPU cost making up the rest (unbounded, at 1.07 Gb/s on
    these runs, 1.4 Gb/s on those of 2026-11-25); the link's rate bounds it below."""
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
    """2 x 2 with 256 KiB, 64 KiB and 1 MiB pieces (held out: another knob; 2, 5 and 2 runs, 11 sizes from
    16 KiB to 16 MiB).  Small buffers take the flat path's recursive doubling (up to 32 KiB) or a ring of
    few steps, while hierarchical pays two ordering points of 4 ranks on 2 cores: flat is faster below a
    crossover, hierarchical above it.  Up to 256 KiB every piece size runs the same path (one piece), so
    the model names one crossover for all three, 42 KiB; the lab's medians over runs put it at 46, 63 and
    96 KiB: factors 0.93 and 0.67, within the issue's 2, and 0.44 with 1 MiB pieces, not.  That spread is
    the lab's own: at 64 KiB hierarchical took 0.84-0.88 ms in both runs with 256 KiB pieces and 1.07-1.12
    ms in both with 1 MiB pieces, the same code on the same bytes, minutes apart.  From 1 MiB every point
    is within 15 %."""
    model_says = set()
    for files, low in ((SEGMENTS_2X2["256k"], 0.9), (SEGMENTS_2X2["64k"], 0.65), (SEGMENTS_2X2["1m"], 0.42)):
        check = _check(model_file, tmp_path, files)
        capsys.readouterr()
        [cross] = check["crossover"]
        assert cross["repeats"] == len(files) and cross["sizes"] == 11 and cross["winners_agree"] >= 10, cross
        for side in ("measured", "predicted"):
            assert cross[side].startswith("crossover at") and "flat below, hierarchical above" in cross[side], cross
        assert low <= cross["factor"] <= 2.0, cross
        model_says.add(cross["predicted"])
        big = [p for p in check["points"] if p["size"] >= 1 << 20]
        errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in big]
        assert len(big) == 15 and all(abs(p["rel_error"]) <= 0.15 for p in big), errors
    assert len(model_says) == 1


def test_small_segments_on_8_ranks(model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """256 KiB pieces with 8 ranks on 2 cores, held out twice (another knob; 4 x 2 another host count).
    On 4 x 2 (five runs, 12 sizes from 64 KiB to 16 MiB) each piece's ordering points and ring steps wait
    for cores, and from a few pieces on the flat ring overtakes hierarchical: model and measurement name
    a crossover the same way round, but measured at 3.79 MiB and predicted at 522 KiB (a factor of 0.13:
    the model charges the flat ring on four hosts too little, as in the 4 x 2 sweep), the same winner at
    all 12 sizes.  The five runs on their own cross at 156 KiB and 3.27-6.06 MiB, four of them within a
    factor of 2 of the median's.  From 1 MiB hierarchical is within 4 %, MPI within 13 %, flat under by
    0-16 %.  On 2 x 4 (two runs, 7 sizes) hierarchical wins at every size, measured and predicted, and
    from 1 MiB every path is within 8 % (fitted on the runs of 2026-11-25, hierarchical was over-predicted
    by 14-32 % on that day's 2 x 4 runs and by 30-37 % on these)."""
    check = _check(model_file, tmp_path, SEGMENTS_4X2)
    capsys.readouterr()
    [cross] = check["crossover"]
    assert cross["repeats"] == 5 and cross["sizes"] == cross["winners_agree"] == 12, cross
    own = sorted(cross["repeat_crossovers"])
    assert cross["repeats_within_2x"] == 4 and own[0] < 200 << 10 and 3.2 < own[1] / (1 << 20) < own[-1] / (1 << 20) < 6.2, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("crossover at") and "hierarchical below, flat above" in cross[side], cross
    assert 0.1 < cross["factor"] < 0.5, cross
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    errors = [(p["source"], p["algorithm"], p["size"], round(p["rel_error"], 3)) for p in big]
    assert len(big) == 21 and all(abs(p["rel_error"]) <= 0.13 for p in big if p["algorithm"] == "mpi"), errors
    assert all(abs(p["rel_error"]) <= 0.04 for p in big if p["algorithm"] == "hierarchical"), errors
    assert all(-0.17 < p["rel_error"] < 0 for p in big if p["algorithm"] == "flat"), errors
    check = _check(model_file, tmp_path, SEGMENTS_2X4)
    capsys.readouterr()
    [cross] = check["crossover"]
    assert cross["winners_agree"] == cross["sizes"] == 7, cross
    for side in ("measured", "predicted"):
        assert cross[side].startswith("no crossover: hierarchical is faster"), cross
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(big) == 9 and all(abs(p["rel_error"]) <= 0.08 for p in big), big


def test_small_calls_with_a_core_per_rank_by_route(model_file: Path) -> None:
    """The latency runs (in the fit): the engine's four routes at 1 and 4 KiB (2 x 1: recursive doubling
    39-44 us, the ring 94-108 us; one host: the agreed one-shot 4 us, the two-shot 34-35 us) within 7 %,
    and MPI_Allreduce at 1 KiB within 10 %."""
    points = [p for p in json.loads(model_file.read_text())["fit_points"]
              if "lat-" in p["source"] and p["size"] <= 4096]
    assert len(points) == 20
    engine = [p for p in points if p["algorithm"] != "mpi"]
    assert all(abs(p["rel_error"]) <= 0.07 for p in engine), engine
    assert all(abs(p["rel_error"]) <= 0.10 for p in points if p["algorithm"] == "mpi" and p["size"] == 1024), points


def test_the_crossover_for_single_tensors_and_for_fused_buckets(model_file: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """A single small tensor takes the flat path's short route (recursive doubling, no planning); a
    training job's fused buckets never do: ``predict`` names the crossover of each.  On the lab's 2 x 2 (4
    ranks on 2 cores) both put flat ahead below about 35 KiB (42 KiB interpolated between the lab's sizes,
    as ``--check`` reads it; the lab's runs: 46-96 KiB); on 4 x 2
    real hosts, with a core per rank, hierarchical wins at every size for both: a host's ranks meet
    through shared memory, where flat's recursive doubling pays a message for every swap."""
    def predict(*extra: str) -> tuple[dict, str]:
        out = tmp_path / "p.json"
        assert main(["model", "predict", "--model-file", str(model_file), "--link-gbps", "1", "--no-report",
                     "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())["crossover"], capsys.readouterr().out

    cross, text = predict("--hosts", "2", "--ranks-per-host", "2", "--oversubscription", "2")
    for c in (cross, cross["buckets"]):
        assert c["faster_below"] == "flat" and c["faster_above"] == "hierarchical" and len(c["sizes"]) == 1, cross
        assert 24 << 10 < c["sizes"][0] < 48 << 10, cross
    assert "for a training job's fused buckets (no short route): crossover at" in text
    cross, text = predict("--hosts", "4", "--ranks-per-host", "2")
    for c in (cross, cross["buckets"]):
        assert c["sizes"] == [] and c["faster_below"] == c["faster_above"] == "hierarchical", cross


def test_the_runs_of_another_day(model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same commands recorded two days earlier (2026-11-25, the engine at bd38eec: the coordinator, the
    device path and parts of the host path changed before the one-day set; MPI_Allreduce, unchanged,
    took 0.9-1.3 times as long on the same layouts that day): the fitted layouts' held-out
    sizes from 1 MiB are still within 15 % at 22 of 24 points, and the step times of the ResNet-50 replay
    within 15 % (the largest error 14.0 %).  Other layouts fare worse across days (the 4 x 2 sweep 9 of 15
    from 1 MiB): the README's table has the row."""
    sweeps = [OTHER_DAY / p.name for p in SWEEPS]
    check = _check(model_file, tmp_path, sweeps, "256KiB,4MiB,64MiB")
    capsys.readouterr()
    big = [p for p in check["points"] if p["size"] >= 1 << 20]
    assert len(big) == 24 and sum(abs(p["rel_error"]) <= 0.15 for p in big) == 22, big
    out = tmp_path / "steps.json"
    assert main(["model", "predict", "--model-file", str(model_file), "--hosts", "2", "--ranks-per-host", "2",
                 "--link-gbps", "1", "--oversubscription", "2", "--scenario", "replay-resnet50-lab", "--no-report",
                 "--json", str(out), "--check-steps", *(str(OTHER_DAY / p.name) for p in LANDSCAPES)]) == 0
    points = json.loads(out.read_text())["check_steps"]
    assert len(points) == 6 and all(abs(p["rel_error"]) <= 0.15 for p in points), points


def test_pinned_knobs_hold_in_the_step_grid_and_a_half_precision_landscape_moves_half_the_bytes(
        model_file: Path, tmp_path: Path) -> None:
    """``--knob`` holds for every setting of the step-time grid; a landscape recorded in float16 is
    predicted with 2-byte gradients (its step times are the float32 ones, so only the prediction moves)."""
    out = tmp_path / "steps.json"
    base = ["model", "predict", "--model-file", str(model_file), "--hosts", "2", "--ranks-per-host", "2",
            "--link-gbps", "1", "--oversubscription", "2", "--scenario", "replay-resnet50-lab", "--no-report",
            "--json", str(out)]
    assert main([*base, "--knob", "hierarchical=false", "--knob", "segment_bytes=1MiB"]) == 0
    rows = json.loads(out.read_text())["step"]["rows"]
    assert len(rows) > 1 and all(not r["knobs"]["hierarchical"] and r["knobs"]["segment_bytes"] == 1 << 20
                                 for r in rows), rows[:3]
    half = json.loads(LANDSCAPES[0].read_text())
    half["dtype"] = "float16"
    (tmp_path / "half.json").write_text(json.dumps(half))
    predicted = {}
    for name, path in (("float32", LANDSCAPES[0]), ("float16", tmp_path / "half.json")):
        assert main([*base, "--check-steps", str(path)]) == 0
        predicted[name] = {json.dumps(p["knobs"], sort_keys=True): p["predicted_s"]
                           for p in json.loads(out.read_text())["check_steps"]}
    assert predicted["float16"].keys() == predicted["float32"].keys()
    assert all(predicted["float16"][k] < predicted["float32"][k] for k in predicted["float32"])


def test_first_proposals_on_hosts_of_unknown_link_use_the_models_one_link(model_file: Path) -> None:
    from tunelab.model.tuner import job_proposals
    from tunelab.scenarios import load_scenario
    from tunelab.tuning.space import search_space

    p = load_scenario("replay-resnet50-lab").as_params()
    space = search_space({}, 2)
    unknown, said = job_proposals(str(model_file), p, 2, 2, None, 2.0, space)
    known, _ = job_proposals(str(model_file), p, 2, 2, 1.0, 2.0, space)
    assert unknown and unknown == known, said


def test_a_model_without_the_hierarchical_path_predicts_what_it_can(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Fitted on one rank per host (no shared-memory step): the table has the flat ring and MPI, the
    crossover says it is not predicted, and the JSON is written (it used to stop mid-output, exit 2)."""
    model = tmp_path / "flat.json"
    assert main(["model", "fit", *map(str, SWEEPS[:2]), "--out", str(model)]) == 0
    out = tmp_path / "p.json"
    assert main(["model", "predict", "--model-file", str(model), "--hosts", "2", "--ranks-per-host", "2",
                 "--sizes", "4KiB", "--no-report", "--json", str(out)]) == 0
    assert "# flat vs hierarchical: not predicted (the model has no fitted" in capsys.readouterr().out
    assert json.loads(out.read_text())["crossover"] is None
