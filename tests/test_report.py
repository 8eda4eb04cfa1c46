"""``tunelab report``: self-contained HTML from recorded tune/bench results (tests/data/report-*.json)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")
pytest.importorskip("jinja2")

from tunelab.cli import main
from tunelab.profiles import ProfileStore
from tunelab.report.build import build_html

DATA = Path(__file__).resolve().parent / "data"
LANDSCAPE = Path(__file__).resolve().parents[1] / "tunelab" / "bench" / "landscapes" / "resnet50-torch-2ranks-10ms.json"
BENCHES = ["report-allreduce.json", "report-fusion.json", "report-kernels.json", "report-tuner.json"]
PAYLOAD = "<script>document.title='pwned'</script>"
CHROMIUM = Path("/usr/bin/chromium")
FIGURES = ["tune-0-convergence", "tune-0-landscape", "tune-1-convergence", "tune-1-landscape",
           "fig-busbw", "fig-fusion", "fig-kernels", "fig-tuner"]
SECTIONS = ["tune-0", "tune-1", "bench-allreduce", "bench-fusion", "bench-kernels", "bench-tuner"]
IMG = re.compile(r'<figure class="report-figure" id="([^"]+)">\s*<img alt="[^"]*" src="data:image/png;base64,'
                 r'([A-Za-z0-9+/=]+)">')


@pytest.fixture
def inputs(tmp_path: Path) -> dict:
    """The recorded tune run with a hostile model name, its profile imported into this test's store."""
    store = ProfileStore()
    [profile_id] = store.import_(json.loads((DATA / "report-profile-export.json").read_text()))
    tune = json.loads((DATA / "report-tune.json").read_text())
    tune["model"] = PAYLOAD
    tune["profile_id"], tune["store"] = profile_id, str(store.path)
    tune_path = tmp_path / "evil-tune.json"
    tune_path.write_text(json.dumps(tune))
    second = tmp_path / "other-host-$^$-allreduce.json"  # (labels from file names: no math is read in them)
    shutil.copy(DATA / "report-allreduce.json", second)
    benches = [DATA / b for b in BENCHES] + [second]
    return {"tune": tune_path, "profile": profile_id, "benches": benches}


@pytest.fixture
def report(inputs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    out = tmp_path / "out" / "report.html"
    argv = ["report", "--tune", str(inputs["tune"]), "--profile", str(inputs["profile"]),
            "--title", f"run {PAYLOAD}", "--out", str(out)]
    for b in inputs["benches"]:
        argv += ["--bench", str(b)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    return out


def _pixels(png: bytes):
    import matplotlib.image as mpimg

    return mpimg.imread(io.BytesIO(png), format="png")


def _not_blank(png: bytes) -> bool:
    px = _pixels(png)[..., :3].reshape(-1, 3)
    return bool((px != px[0]).any())


def test_report_is_self_contained_and_complete(report: Path) -> None:
    html = report.read_text()
    assert "http://" not in html and "https://" not in html
    refs = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", html, re.IGNORECASE)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs), "a src/href that is not a data URI"
    assert "<script" not in html.lower()
    for sid in SECTIONS:
        assert f'id="{sid}"' in html, sid
    figures = dict(IMG.findall(html))
    assert sorted(figures) == sorted(FIGURES)
    for fig_id, data in figures.items():
        png = base64.b64decode(data)
        assert png.startswith(b"\x89PNG") and _not_blank(png), fig_id
    for text in ("Hardware: CPU", "default vs locked throughput", "locked configuration", "trials",
                 "nccl-tests style results: report-allreduce.json", "other-host-$^$-allreduce.json",
                 "tunelab profiles export", "load it automatically"):
        assert text in html, text


def test_bench_tables_give_their_units(tmp_path: Path) -> None:
    """Bandwidth columns read GB/s (bytes), not "gbps" beside a link's Gb/s (bits) in the same page; the
    link-bound ratio is shown; a row that has no check says n/a, not NaN."""
    data = json.loads((DATA / "report-allreduce.json").read_text())
    data["hardware"]["link_gbps"] = 1.0
    for r in data["rows"]:
        r["time_vs_link"] = 1.25
    data["rows"][0]["wrong"] = None
    bench = tmp_path / "linked-allreduce.json"
    bench.write_text(json.dumps(data))
    html = build_html("units", [], [bench, DATA / "report-kernels.json", DATA / "report-fusion.json"], [])
    for heading in ("algbw (GB/s)", "busbw (GB/s)", "time (us)", "time / link bound", "copy (GB/s)"):
        assert f"<th>{heading}</th>" in html, heading
    assert "gbps</th>" not in html and "<td>1 Gb/s</td>" in html
    assert "<td>n/a</td>" in html and "NaN" not in html


def test_a_run_the_store_failed_says_so_not_no_store(tmp_path: Path) -> None:
    tune = json.loads((DATA / "report-tune.json").read_text())
    tune.pop("profile_id", None)
    tune["store_error"] = "database or disk is full"
    path = tmp_path / "failed-tune.json"
    path.write_text(json.dumps(tune))
    html = build_html("t", [], [], [path])
    assert "the profile store failed (database or disk is full)" in html and "--no-store" not in html
    tune.pop("store_error")
    path.write_text(json.dumps(tune))
    assert "This run was not stored (--no-store)" in build_html("t", [], [], [path])


def test_user_text_is_escaped(report: Path) -> None:
    html = report.read_text()
    assert PAYLOAD not in html
    assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in html


def test_profile_only_report_and_errors(inputs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    html = build_html("p", [inputs["profile"]], [], [])
    assert 'id="tune-0-landscape"' in html and "Hardware: CPU" in html
    assert main(["report", "--profile", "999", "--out", str(tmp_path / "x.html")]) == 1
    assert "no profile 999" in capsys.readouterr().err
    assert main(["report", "--bench", str(inputs["tune"]), "--out", str(tmp_path / "y.html")]) == 2  # wrong file
    assert "not a tunelab bench --json result" in capsys.readouterr().err
    assert main(["report", "--bench", str(tmp_path / "missing.json"), "--out", str(tmp_path / "y.html")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_default_out_folder(inputs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--bench", str(DATA / "report-kernels.json")]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out.parent == Path("reports") and out.name.startswith("report-") and out.suffix == ".html"
    assert (tmp_path / out).is_file()
    # two reports made in one second (two commands at once) each keep their own file
    from tunelab.report import build

    monkeypatch.setattr(build.os, "getpid", lambda: 424242)
    assert main(["report", "--bench", str(DATA / "report-fusion.json")]) == 0
    second = Path(capsys.readouterr().out.strip())
    assert second != out and second.name.endswith("-424242.html") and (tmp_path / out).is_file()


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0", *args, url]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "Uncaught" in line or "ERROR:CONSOLE" in line]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: apt-get install -y chromium")
def test_report_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    dom = _chromium(tmp_path, report.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not _console_errors(dom.stderr)
    title = re.search(r"<title>(.*?)</title>", dom.stdout, re.DOTALL)
    assert title and title.group(1) == "run &lt;script&gt;document.title='pwned'&lt;/script&gt;"
    assert "pwned" not in title.group(1).replace(PAYLOAD.replace("<", "&lt;").replace(">", "&gt;"), "")
    assert "<script" not in dom.stdout.lower()
    assert dom.stdout.count('class="report-figure"') == len(FIGURES)

    shot = tmp_path / "page.png"
    run = _chromium(tmp_path, report.as_uri(), "--window-size=1200,2000", f"--screenshot={shot}")
    assert run.returncode == 0 and not _console_errors(run.stderr)
    assert _not_blank(shot.read_bytes())
    _figures_render(report, tmp_path)


def _figures_render(report: Path, tmp_path: Path) -> None:
    """Each figure alone on a page: Chromium decodes it and draws something other than one colour."""
    for fig_id, data in IMG.findall(report.read_text()):
        page = tmp_path / f"{fig_id}.html"
        page.write_text(f'<!DOCTYPE html><html><body style="margin:0;background:#fff">'
                        f'<img src="data:image/png;base64,{data}"></body></html>')
        shot = tmp_path / f"{fig_id}.png"
        run = _chromium(tmp_path, page.as_uri(), "--window-size=700,450", f"--screenshot={shot}")
        assert run.returncode == 0 and not _console_errors(run.stderr), fig_id
        assert _not_blank(shot.read_bytes()), fig_id


def test_a_kept_default_shows_the_runner_up(inputs: dict, tmp_path: Path) -> None:
    tune = json.loads(inputs["tune"].read_text())
    tune["runner_up"] = {"knobs": tune["samples"][1]["knobs"], "score": 42.5, "scores": [42.5]}
    path = tmp_path / "kept.json"
    path.write_text(json.dumps(tune))
    html = build_html("kept", [], [], [path])
    assert "not adopted" in html and "<td>42.5</td>" in html
    assert "not adopted" not in build_html("plain", [], [], [inputs["tune"]])


@pytest.mark.parametrize("kept", [True, False])
def test_a_profile_report_says_what_its_run_decided(tmp_path: Path, kept: bool) -> None:
    from tunelab.profiles import ProfileKey
    from tunelab.report.runs import run_from_profile
    from tunelab.report.tuning import drift_text, outcome_text

    store = ProfileStore(tmp_path / "p.sqlite")
    pid = store.upsert_profile(ProfileKey("h" * 16, "m", "torch", 2), "host", {"nodes": 1}, "tiny")
    default, tuned = {"cycle_time_ms": 1.0}, {"cycle_time_ms": 8.0}
    for score, knobs, phase, spread in ((100.0, default, "default", 0.02), (110.0, tuned, "explore", 0.02),
                                        (90.0, default, "default", 0.04)):
        store.record_trial(pid, knobs, score, spread, 3, 2.0, "run-1", phase)
    if kept:
        store.set_best(pid, default, 95.0, 95.0, 0.02, "run-1", steps=40, outcome="budget exhausted")
    else:
        store.set_best(pid, tuned, 110.0, 95.0, 0.02, "run-1", gain_interval=(1.158, 1.05, 1.25), steps=40,
                       outcome="converged")
    run = run_from_profile(pid, store)
    assert run["default"]["spread"] == pytest.approx(0.03)  # over its blocks, as a tune JSON's (was the first's)
    text = outcome_text(run)
    assert "without an interval" not in text
    assert "Tuning measured 3 blocks (40 training steps, 6 s of measured steps)" in text
    if kept:
        assert text.startswith("Kept the default configuration") and "ran out of its budget" in text
    else:
        assert text.startswith("Locked a tuned configuration: 1.16x the default's throughput, 90 % interval "
                               "[1.05, 1.25] (as the profile store recorded it)") and "converged" in text
        conn = sqlite3.connect(tmp_path / "p.sqlite")
        with conn:  # a lock stored before schema 3 kept no estimate, and 1.30 / 0.95 lies outside its interval
            conn.execute("UPDATE best SET gain = NULL, score = 130.0")
        conn.close()
        assert outcome_text(run_from_profile(pid, store)).startswith(
            "Locked a tuned configuration: 90 % interval [1.05, 1.25]x the default's throughput (as the profile")
    assert "ranged from 90.00 to 100.00 samples/s (10.5 % of its mean)" in drift_text(run)  # (100 - 90) / 95


def test_a_profile_report_reads_retunes_and_runs_with_other_pins(tmp_path: Path) -> None:
    """The interval, not a comparison with some run's default knobs, says whether a run locked; a retune's
    outcome is read through its prefix; only the search that set the best is counted, not the locked
    blocks a retuning run watched before it, nor another run's default."""
    from tunelab.profiles import ProfileKey
    from tunelab.report.runs import run_from_profile
    from tunelab.report.tuning import outcome_text

    store = ProfileStore(tmp_path / "p.sqlite")
    pid = store.upsert_profile(ProfileKey("h" * 16, "m", "torch", 2), "host", {"nodes": 1}, "tiny")
    base, tuned = {"cycle_time_ms": 1.0}, {"cycle_time_ms": 8.0}
    trials = [(100.0, base, "default"), (110.0, tuned, "explore"), (99.0, base, "default"),  # the first search
              (108.0, tuned, "locked"), (80.0, tuned, "locked"),                              # watched, then re-opened
              (90.0, base, "default"), (91.0, tuned, "explore"), (94.0, base, "default"), (92.0, base, "default")]
    for score, knobs, phase in trials:
        store.record_trial(pid, knobs, score, 0.02, 3, 2.0, "run-1", phase)
    store.set_best(pid, base, 92.0, 92.0, 0.02, "run-1", steps=30, outcome="retuned: converged, default kept")
    time.sleep(0.01)  # then the job watched again and ended in the middle of a third search, never locked
    for score, knobs, phase in ((93.0, base, "locked"), (60.0, tuned, "explore"), (61.0, base, "default")):
        store.record_trial(pid, knobs, score, 0.02, 3, 2.0, "run-1", phase)
    run = run_from_profile(pid, store)
    assert run["outcome"]["adopted"] is False and run["outcome"]["converged"] is True
    text = outcome_text(run)
    assert text.startswith("Kept the default configuration (no configuration cleared the minimum gain)")
    assert "measured 4 blocks (30 training steps, 8 s" in text
    assert text.endswith("the search (one a retune re-opened after an earlier lock) converged.")
    assert run["outcome"]["drift"]["reference_scores"] == [90.0, 94.0, 92.0]

    # a later run that pinned the segment and kept its own default: not "adopted", and its default is its own
    pinned = {"cycle_time_ms": 1.0, "segment_bytes": 1 << 20}
    for score, knobs, phase in ((100.0, pinned, "default"), (100.5, {**pinned, "cycle_time_ms": 8.0}, "explore"),
                                (99.0, pinned, "default")):
        store.record_trial(pid, knobs, score, 0.02, 3, 2.0, "run-2", phase)
    store.set_best(pid, pinned, 99.5, 99.5, 0.02, "run-2", steps=20, outcome="every knob is pinned")
    run = run_from_profile(pid, store)
    assert run["outcome"]["adopted"] is False and run["default"]["knobs"] == pinned
    text = outcome_text(run)
    assert text.startswith("Kept the default configuration (every knob was pinned)")
    assert "the search ended (every knob is pinned)" in text and "budget" not in text
    # its figures and trial table hold that run's blocks alone, and its searched knobs are the cycle's
    # (they held every run's 15 blocks, ratios to run 1's default drawn beside run 2's)
    assert [(s["score"], s["phase"]) for s in run["samples"]] == [(100.0, "default"), (100.5, "explore"),
                                                                  (99.0, "default")]
    assert run["searched"] == ["cycle_time_ms"]


def test_a_lock_from_exploration_says_so_rather_than_naming_re_measurements() -> None:
    """A lock whose interval rests on exploration blocks (no round was spent) does not claim
    re-measurements: the report names the blocks it rests on and the simultaneous confidence."""
    from tunelab.report.tuning import outcome_text

    iv = {"gain": 1.3, "low": 1.2, "high": 1.4, "n": 2}
    base = {"adopted": True, "gain_interval": iv, "samples_to_lock": 9, "steps_to_lock": 40, "seconds_to_lock": 30.0,
            "converged": True, "stop_reason": "converged (a promising configuration: 1.300x estimated)"}
    text = outcome_text({"outcome": {**base, "locked_from": "exploration"}})
    assert "from its 2 exploration blocks paired with the default, at a confidence that holds for every" in text
    assert "re-measurement" not in text.replace("no re-measurement", "")
    text = outcome_text({"outcome": {**base, "locked_from": "re-measurement"}})
    assert "from 2 re-measurements paired with the default" in text
    # a tune result's seconds are its training's until the lock, warm-up and discarded steps included
    assert "(40 training steps, 30 s of training) before locking" in text


def test_the_trials_table_shows_sizes_as_tune_prints_them_and_the_locked_table_exactly() -> None:
    from tunelab.knobs import Knobs
    from tunelab.report.tuning import tuning_section

    odd = Knobs(fusion_threshold_bytes=69712 * 1024, segment_bytes=11600 * 1024).as_dict()
    run = {"model": "m", "hardware_name": "h", "label": "x", "hardware_facts": {"cpu_model": "C", "cpu_cores": 2},
           "samples": [{"index": 0, "phase": "explore", "role": "candidate", "knobs": odd, "score": 1.0,
                        "spread": 0.01}],
           "default": {"knobs": Knobs().as_dict(), "score": 1.0, "spread": 0.01},
           "best": {"knobs": odd, "score": 1.0, "spread": 0.01}, "locked_final": None, "searched": []}
    blocks = tuning_section(run, 0)["blocks"]
    tables = {b["caption"]: str(b["html"]) for b in blocks if b.get("kind") == "table"}
    assert "<td>68.1MiB</td>" in tables["trials"] and "<td>11.3MiB</td>" in tables["trials"]
    assert "KiB" not in tables["trials"]
    assert "<td>69712KiB</td>" in tables["locked configuration"] and "<td>11600KiB</td>" in tables["locked configuration"]
    assert blocks[1]["text"].startswith("Model m (x). Hardware: CPU C (2 cores)")


@pytest.mark.parametrize("damage, named", [
    (lambda d: d["samples"][1].pop("phase"), "sample 2 of this tune result is damaged (KeyError: 'phase')"),
    (lambda d: d["samples"][0]["knobs"].update(segment_bytes=-1), "sample 1 of this tune result is damaged"),
    (lambda d: d["samples"][0].update(score="fast"), "sample 1 of this tune result is damaged (ValueError"),
    (lambda d: d["best"].pop("knobs"), "the best of this tune result is damaged (KeyError: 'knobs')"),
    (lambda d: d.pop("samples"), "not a tunelab tune --json result"),
    (lambda d: d.update(first_proposals={"knobs": "fast"}), "first_proposals must be an object with a list"),
])
def test_a_damaged_tune_result_is_one_line_and_exit_2(inputs: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     damage, named) -> None:
    data = json.loads(inputs["tune"].read_text())
    damage(data)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(data))
    assert main(["report", "--tune", str(path), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("name, damage, named", [
    ("report-allreduce.json", lambda d: d["rows"][3].update(busbw_gbps="x"),
     "a damaged tunelab bench allreduce result (row 4 (gloo): busbw_gbps must be a number, got 'x')"),
    ("report-allreduce.json", lambda d: d["rows"].__setitem__(1, [1]), "(row 2 has no algorithm)"),
    ("report-allreduce.json", lambda d: d.update(rows=5), "not a tunelab bench --json result"),
    ("report-kernels.json", lambda d: d["rows"][0].pop("copy_gbps"), "copy_gbps must be a number, got None"),
    ("report-tuner.json", lambda d: d["curves"].update(tunelab=["a"]), "its curves must be lists of numbers"),
    (LANDSCAPE, lambda d: d["points"][2]["scores"].append(-1.0),
     "a damaged tunelab bench landscape result (point 3: its scores must be a list of positive numbers)"),
    (LANDSCAPE, lambda d: d["points"][0]["knobs"].update(cycle_time_ms="x"), "point 1: its knobs are not knobs"),
])
def test_a_damaged_bench_result_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, name, damage,
                                                      named) -> None:
    data = json.loads((DATA / name).read_text())
    damage(data)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(data))
    assert main(["report", "--bench", str(path), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "damaged.json" in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_landscape_is_reported_best_first_with_its_default_marked(tmp_path: Path) -> None:
    """``bench landscape``'s JSON (a shipped recording) in a report: a figure, and a table of its points
    ranked by their mean over the visits (the order and figures numpy gives), the default marked."""
    data = json.loads(LANDSCAPE.read_text())
    out = tmp_path / "r.html"
    assert main(["report", "--bench", str(LANDSCAPE), "--out", str(out)]) == 0
    html = out.read_text()
    assert [m[0] for m in IMG.findall(html)] == ["fig-landscape-0"]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))
    means = sorted(((float(np.mean(pt["scores"])), pt) for pt in data["points"]), key=lambda m: -m[0])
    best, (last, last_pt) = means[0][0], means[-1]
    assert means[0][1]["knobs"]["fusion_threshold_bytes"] == 0 and means[0][1]["knobs"]["cycle_time_ms"] == 32
    assert f"1 fusion=off cycle=32ms segment=256KiB {best:.4g}" in text, text[:2000]
    assert f"24 fusion=64MiB cycle=1ms segment=4MiB {last:.4g} {min(last_pt['scores']):.4g}" in text
    default = next(i for i, (_, pt) in enumerate(means) if pt["knobs"] == data["space"]["base"])
    assert f"{default + 1} fusion=64MiB cycle=10ms segment=4MiB (recorded default) {means[default][0]:.4g}" in text
    assert "hier=" not in text  # one node: hierarchical is not a knob of this grid
    assert text.count("(recorded default)") == 1 and f"{means[default][0] / best:.4g} 5" in text
    # its hardware as people read it (the bytes as a size, a banner on one line), as bench allreduce's is
    assert "memory_bytes 23.5 GiB" in text and "MPICH Version: 5.0.2" in text and "25276510208" not in text, text


def test_the_tuner_section_counts_the_targets_each_strategy_meets(tmp_path: Path) -> None:
    """The scoreboard of a tuner result as a table (counts as the result gives them; an older file without
    one still renders, without the table)."""
    data = json.loads((DATA / "report-tuner.json").read_text())
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert main(["report", "--bench", str(path), "--out", str(tmp_path / "old.html")]) == 0
    assert "targets met" not in (tmp_path / "old.html").read_text()
    data["scoreboard"] = {
        "targets": {"tunelab": {"landscapes": 4, "samples_to_lock": 1, "within_3pct": 3, "worse_than_default": 4},
                    "random": {"landscapes": 4, "samples_to_lock": 0, "within_3pct": 2, "worse_than_default": 3}},
        "within_3pct_versus": {"tunelab vs random": {"ahead": 2, "level": 1, "behind": 1},
                               "random vs tunelab": {"ahead": 1, "level": 1, "behind": 2}}}
    path.write_text(json.dumps(data))
    out = tmp_path / "r.html"
    assert main(["report", "--bench", str(path), "--out", str(out)]) == 0
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text()))
    assert "tunelab 1 of 4 3 of 4 4 of 4 –" in text and "random 0 of 4 2 of 4 3 of 4 2 / 1 / 1" in text, text[-800:]
    assert "for scale" not in text  # (a file from before the ceiling: no such row)
    data["scoreboard"]["ceiling"] = {"landscapes": 4, "exhaustive_within_3pct": 2, "exhaustive_blocks": 24,
                                     "recording_knows_best": 3, "recording_known": 4}
    path.write_text(json.dumps(data))
    assert main(["report", "--bench", str(path), "--out", str(out)]) == 0
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text()))
    assert "for scale: every point once, exact reference (24 blocks), the best kept – 2 of 4 – –" in text, text[-800:]


def test_the_tuner_section_says_what_each_landscape_is(tmp_path: Path) -> None:
    """Each landscape's default against its best, the yardstick, and the recording drift the replay took
    out, in words; an entry with nothing readable still makes a row, not a traceback."""
    data = json.loads((DATA / "report-tuner.json").read_text())
    data["landscapes"]["resnet50-torch-2ranks"].update(
        exhaustive_within_3pct=0.7, block_steps=3, recording_drift_removed={"sigma": 0.0401, "lag1": 0.63},
        truth_ceiling_within_3pct=0.75)
    data["landscapes"]["broken"] = {"best": "x", "recording_drift_removed": {"sigma": "x", "lag1": 1}}
    data["rows"][0]["locked_low_end_held_frac"] = None  # nothing locked: n/a, not NaN
    path = tmp_path / "tuner.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "r.html"
    assert main(["report", "--bench", str(path), "--out", str(out)]) == 0
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text()))
    assert "resnet50-torch-2ranks 32 0.940 0.70 (3-step blocks) 0.75 sd 4.01 %, lag-1 0.63" in text, text[-800:]
    assert "broken n/a n/a n/a n/a none" in text and "NaN" not in text, text[-800:]


def test_the_tuner_section_shows_what_starting_from_the_model_changed(tmp_path: Path) -> None:
    """Seeded rows name their first proposals in words, not as dicts, and ``model_first`` is a table of its own."""
    data = json.loads((DATA / "report-tuner.json").read_text())
    seeded = {**data["rows"][0], "strategy": "tunelab+model",
              "first_proposals": [{"fusion_threshold_bytes": 64 << 20, "cycle_time_ms": 8.0, "segment_bytes": 4 << 20,
                                   "hierarchical": True}]}
    data["rows"].append(seeded)
    data["model_first"] = {"tunelab": {"landscapes": 5, "samples_to_lock": {"fewer": 1, "same": 1, "more": 3},
                                       "within_3pct": {"ahead": 4, "level": 0, "behind": 1}}}
    path = tmp_path / "tuner.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "r.html"
    assert main(["report", "--bench", str(path), "--out", str(out)]) == 0
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text()))
    assert "fusion=64MiB cycle=8ms segment=4MiB hier=on" in text and "'fusion_threshold_bytes'" not in text
    assert "tunelab+model vs tunelab 5 1 / 1 / 3 4 / 0 / 1" in text, text[-800:]


def test_a_tune_run_that_started_from_the_scale_model_says_so(tmp_path: Path) -> None:
    """tune's JSON names the model's first proposals; the report says the search started there, in words."""
    import html

    from tunelab.knobs import Knobs

    data = json.loads((DATA / "report-tune.json").read_text())
    data.pop("profile_id", None)
    data["first_proposals"] = {"source": "scale model", "model_file": "/m/model.json",
                               "knobs": [{**Knobs().as_dict(), "fusion_threshold_bytes": 8 << 20, "cycle_time_ms": 0.5}]}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "r.html"
    assert main(["report", "--tune", str(path), "--out", str(out)]) == 0
    text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text())))
    assert ("The search started from the scale model's predicted best settings (/m/model.json; this hardware had "
            "no stored trials): fusion threshold 8MiB, cycle time 0.5 ms, segment 4MiB.") in text, text[:1500]
    data.pop("first_proposals")
    path.write_text(json.dumps(data))
    assert main(["report", "--tune", str(path), "--out", str(out)]) == 0
    assert "scale model" not in out.read_text()
    assert "Hardware facts were not recorded for this run." in text  # no store, no facts in the file: said so
    # a run kept out of the store (--no-store) records its hardware in its own output
    data["hardware"], data["hardware_name"] = {"cpu_model": "AMD EPYC", "cpu_cores": 2, "memory_gib": 24,
                                               "gpu_count": 0, "nodes": 2, "ranks_per_node": [2, 2],
                                               "lab_link": "1 Gb/s"}, "epyc-2c"
    path.write_text(json.dumps(data))
    assert main(["report", "--tune", str(path), "--out", str(out)]) == 0
    text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text())))
    assert "Hardware: CPU AMD EPYC (2 cores); 24 GiB memory; no GPU; 2 nodes of 2, 2 ranks; lab link 1 Gb/s" in text
    # nothing stored: the report does not tell jobs to load it, nor to export a profile (it did both)
    assert "This run was not stored (--no-store)" in text and "load it automatically" not in text
    assert "profiles export" not in text
    # stored, in a store that (at the same path, on another machine) holds another profile under its id:
    # the run's own record of its hardware wins (the store's was shown)
    store = ProfileStore()
    [other] = store.import_(json.loads((DATA / "report-profile-export.json").read_text()))
    theirs = store.get(other).hardware_facts["cpu_model"]
    data["profile_id"], data["store"] = other, str(store.path)
    data["hardware"]["cpu_model"] = "Recorded CPU"
    path.write_text(json.dumps(data))
    assert main(["report", "--tune", str(path), "--out", str(out)]) == 0
    text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", out.read_text())))
    assert "CPU Recorded CPU (2 cores)" in text and theirs not in text, theirs
    assert f"tunelab profiles export {other} --out profile.json" in text


def test_figures_draw_log_ticks_as_numbers_and_given_labels_as_written():
    """Every text of a figure is drawn as written (no math read in user strings), but a log axis' own
    tick labels are math (2^10): with math off for them too, every report's log axes showed
    ``$\\mathdefault{2^{10}}$`` as text.  A categorical label with a lone ``$`` draws as written."""
    from tunelab.report.figures import new_figure, to_data_uri

    fig, ax = new_figure()
    ax.plot([1024, 4096, 65536], [1, 2, 3], label="host $a")
    ax.set_xscale("log", base=2)
    ax.set_yticks([1, 2, 3], labels=["one $", "two", "three"])
    ax.legend()
    assert to_data_uri(fig).startswith("data:image/png;base64,")  # (drawn: the ticks are the drawn ones)
    log_ticks = [t for t in ax.xaxis.get_ticklabels() if t.get_text()]
    assert log_ticks and all("mathdefault" in t.get_text() and t.get_parse_math() for t in log_ticks)
    given = [t for t in ax.yaxis.get_ticklabels() if t.get_text()]
    assert [t.get_text() for t in given] == ["one $", "two", "three"]
    assert not any(t.get_parse_math() for t in given)
    assert not ax.get_legend().get_texts()[0].get_parse_math()


def test_the_outcome_in_words_says_a_converged_reason_once_and_counts_one_block() -> None:
    """"the search converged (converged (a promising ...))" and "Tuning measured 1 blocks"."""
    from tunelab.report.tuning import outcome_text

    def run(reason, blocks):
        return {"outcome": {"samples_to_lock": blocks, "steps_to_lock": 30, "seconds_to_lock": 12.0,
                            "converged": reason.startswith("converged"), "stop_reason": reason,
                            "adopted": False, "decision": "no gain cleared the minimum"},
                "best": {"score": 1.0}, "default": {"score": 1.0}}

    text = outcome_text(run("converged (a promising configuration: 1.080x estimated)", 12))
    assert "the search converged (a promising configuration: 1.080x estimated)." in text, text
    assert "converged (converged" not in text
    assert "Tuning measured 1 block (30 training steps" in outcome_text(run("budget exhausted", 1))


def test_a_tune_json_whose_lock_came_from_a_reopened_search_says_so(inputs: dict, tmp_path: Path) -> None:
    """A `tune --retune` result locked by a search the watch re-opened: its block and step counts are
    that search's, and the words said nothing of it (a profile's report did)."""
    from tunelab.report.runs import run_from_json
    from tunelab.report.tuning import outcome_text

    data = json.loads(inputs["tune"].read_text())
    data.update(gain_interval=None, adopted=False, decision="no configuration cleared the minimum gain",
                converged=True, stop_reason="converged", samples_to_lock=5, steps_to_lock=20, seconds_to_lock=3.0,
                outcome="converged")
    assert "one a retune re-opened" not in outcome_text(run_from_json("plain", data))
    data["outcome"] = "retuned: converged"
    text = outcome_text(run_from_json("retuned", data))
    assert "the search (one a retune re-opened after an earlier lock)" in text, text


def test_a_train_benchmarks_hardware_is_shown_as_words() -> None:
    """bench train records the hardware it ran on, as bench allreduce does; its section never showed it."""
    from tunelab.report.bench import train_section

    data = {"model": "resnet50", "framework": "torch", "world_size": 2,
            "rows": [{"system": "tunelab", "samples_per_s": 10.0}, {"system": "ddp", "samples_per_s": 9.0}],
            "hardware": {"cpu_model": "AMD EPYC", "memory_bytes": 25276510208, "frameworks": {"torch": "2.13.0"}}}
    blocks = train_section([("run", data)])["blocks"]
    hardware = next(b for b in blocks if b.get("caption") == "hardware: run")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", str(hardware["html"])))
    assert "memory_bytes 23.5 GiB" in text and "frameworks torch 2.13.0" in text and "{" not in text, text
