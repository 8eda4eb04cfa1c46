"""The tunelab command: bad input gets one line and exit 2; real runs write the documented JSON."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def tunelab(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], capture_output=True, text=True, check=False,
                          timeout=timeout, env={**os.environ, **env} if env else None)


@pytest.mark.parametrize("args,fragment", [
    (["bench", "allreduce", "--algorithms", "ring,nccl"], "unknown choice 'nccl'"),
    (["bench", "allreduce", "--sizes", "12XB"], "invalid size '12XB'"),
    (["bench", "allreduce", "--sizes", "0"], "a size must be at least 1 byte, got '0'"),
    (["bench", "allreduce", "--sizes", "1KiB,,2KiB"], "an empty item in '1KiB,,2KiB'"),
    (["bench", "allreduce", "--sizes", "1KiB,1001", "--dtype", "float64"], "is not a whole number of float64 elements"),
    (["bench", "tuner", "--scenario", "replay-bert"], "--scenario describes the scale model's objective"),
    (["bench", "allreduce", "--json", "."], "cannot write '.': it is a directory"),
    (["bench", "tuner", "--json", "/dev/null/x.json"], "/dev/null is not a directory"),
    (["model", "fit", "a.json", "--out", "tests"], "cannot write 'tests': it is a directory"),
    (["profiles", "export", "--out", "."], "it is a directory"),
    (["report", "--bench", "x.json", "--out", "."], "it is a directory"),
    (["bench", "allreduce", "--np", "0"], "expected a positive integer, got '0'"),
    (["bench", "allreduce", "--np", "two"], "expected a positive integer"),
    (["bench", "allreduce", "--dtype", "float8"], "invalid choice: 'float8'"),
    (["bench", "allreduce", "--knob", "fusion=1"], "expected NAME=VALUE"),
    (["bench", "allreduce", "--knob", "segment_bytes=1"], "out of range 4KiB .. 256MiB"),
    (["bench", "fusion", "--model", "alexnet"], "invalid choice: 'alexnet'"),
    (["bench", "allreduce", "--bogus"], "tunelab bench allreduce: error: unrecognized arguments: --bogus"),
    (["bench", "allreduce", "--link-gbps", "0"], "expected a number > 0, got '0'"),
    (["tune", "--link-gbps", "fast"], "expected a number > 0, got 'fast'"),
    (["tune", "--link-latency-us", "-1"], "expected a number >= 0, got '-1'"),
    (["bench"], "tunelab bench: error: the following arguments are required: {allreduce,fusion,kernels,"),
    (["profiles"], "required: {list,show,export,import,delete}"),
    (["--bogus", "hw"], "tunelab: error: unrecognized arguments: --bogus"),
    (["hw", "--bogus"], "tunelab hw: error: unrecognized arguments: --bogus"),
    ([], "required: {bench,tune,hw,report,profiles,lab,model}"),
])
def test_bad_cli_input_is_one_line_and_exit_2(args, fragment):
    proc = tunelab(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert fragment in lines[0] and lines[0].startswith("tunelab")
    assert proc.stdout == ""


@pytest.mark.parametrize("command", [["tune"], ["bench", "landscape"]])
@pytest.mark.parametrize("how,fragment", [
    ("unknown-name", "no scenario named 'nosuch'"),
    ("missing-file", "missing.toml: no such scenario file"),
    ("bad-toml", "bad.toml: invalid TOML"),
    ("bad-key", "bad.toml: [run].np must be a positive integer"),
])
def test_a_scenario_that_cannot_be_loaded_is_a_usage_error(tmp_path, command, how, fragment):
    (tmp_path / "bad.toml").write_text('workload = "train"\nmodel = "resnet50"\n' +
                                       ("[run]\nnp = 0\n" if how == "bad-key" else "[run\n"))
    which = {"unknown-name": ["--model", "nosuch"], "missing-file": ["--scenario", str(tmp_path / "missing.toml")]}
    proc = tunelab(*command, *which.get(how, ["--scenario", str(tmp_path / "bad.toml")]), timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunelab: error:") and fragment in lines[0], proc.stderr


@pytest.mark.parametrize("args,fragment", [
    (["bench", "landscape", "--dtype", "float16"], "--dtype applies to replay scenarios"),
    (["bench", "landscape", "--model", "replay-bert", "--device", "cuda"], "trains torch models"),
    (["tune", "--model", "replay-bert", "--device", "cuda"], "trains torch models"),
    # knobs the ranks would refuse to record, refused before any rank starts (they said "rank 1:", exit 1)
    (["bench", "landscape", "--model", "replay-bert", "--grid", "hier=true"],
     "grid knob hierarchical cannot be recorded: the tuner does not search it here (one node"),
    (["bench", "landscape", "--model", "replay-bert", "--np", "3", "--ranks-per-node", "2", "--grid", "hier=true"],
     "(nodes of unequal size"),
    (["bench", "landscape", "--model", "replay-bert", "--grid", "oneshot=1KiB,1MiB"], "searched for GPU jobs only"),
    # an image the model cannot take failed inside the ranks (torch's words, exit 1)
    (["bench", "train", "--image-size", "16"], "--image-size must be 32 to 1024 pixels for resnet50, got 16"),
    (["tune", "--image-size", "4096"], "[data].image_size must be 32 to 1024 pixels for resnet50, got 4096"),
    (["report"], "nothing to report"),
])
def test_other_usage_errors_found_after_parsing_exit_2(args, fragment):
    proc = tunelab(*args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def _help_paths():
    from tunelab.cli import build_parser

    def walk(parser, path):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
    return list(walk(build_parser(), []))


def test_every_command_has_help():
    paths = _help_paths()
    assert ["bench", "allreduce"] in paths and ["profiles", "delete"] in paths and ["hw"] in paths
    for path in paths:
        proc = tunelab(*path, "--help", timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: tunelab"), (path, proc.stderr)


def test_the_registry_is_one_module_per_command():
    import importlib

    import tunelab.cli

    commands = {}
    for name in tunelab.cli.COMMANDS:
        module = importlib.import_module(f"tunelab.cli.{name}")
        assert callable(module.register), name
        commands[name] = module
    top = next(a for a in tunelab.cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(top.choices) == list(commands)
    assert {"bench", "tune", "hw", "report", "profiles", "lab"} <= set(commands)


def test_argument_types_are_public_and_free_of_the_bench_package():
    code = ("import sys, tunelab.cli.types as t, tunelab.cli.finish;"
            "assert all(callable(getattr(t, n)) for n in t.__all__);"
            "print(sorted(m for m in sys.modules if m.startswith('tunelab.bench')))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    sources = (Path(__file__).resolve().parents[1] / "tunelab").rglob("*.py")
    private = [str(p) for p in sources if re.search(r"from \.+cli import _|tunelab\.cli import _", p.read_text())]
    assert private == []


@pytest.mark.parametrize("command", [["bench", "allreduce"], ["tune"], ["bench", "landscape"]])
def test_an_emulated_link_without_emulated_nodes_is_refused(command):
    proc = tunelab(*command, "--link-gbps", "10", "--no-report", timeout=60)
    assert proc.returncode == 2 and proc.stdout.count("\n") <= 1  # a usage error, for every command
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "link" in lines[0] and "ranks" in lines[0] and "node" in lines[0], proc.stderr


def test_bench_allreduce_on_the_device_path_under_the_simulator(tmp_path):
    out = tmp_path / "dev.json"
    proc = tunelab("bench", "allreduce", "--device", "cuda", "--np", "2", "--sizes", "4KiB", "--iters", "1",
                   "--warmup", "0", "--json", str(out), "--no-report", timeout=300,
                   env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert "gpu_count" in doc["hardware"]  # a device run records the GPU facts (none under the simulator)
    assert {r["algorithm"] for r in rows} == {"ring", "hierarchical", "mpi", "bound"}
    assert all(r["wrong"] == 0 and r["count"] == 1024 for r in rows if r["algorithm"] != "bound")
    bound = next(r for r in rows if r["algorithm"] == "bound")  # a copy: the floor
    shared = any("share one GPU" in n for n in doc["notes"])  # (the leader copies every rank's bytes)
    assert bound["wrong"] == (None if shared else 0) and bound["time_vs_bound"] == 1.0
    assert "under the CUDA simulator" in proc.stdout and "gloo: skipped" in proc.stdout


def test_gpu_training_without_a_gpu_is_one_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine can train on a GPU")
    proc = tunelab("bench", "train", "--device", "cuda", "--np", "2", "--iters", "1", "--rounds", "1",
                   "--no-report", timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda needs a GPU and a CUDA build of torch" in lines[0], proc.stderr
    proc = tunelab("bench", "train", "--device", "cuda", "--framework", "tensorflow", "--no-report", timeout=60)
    assert proc.returncode == 2 and "trains torch models" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "value"), [("TUNELAB_DEVICE_ORDERING", "bogus"), ("TUNELAB_SHARED_GPU", "sideways")])
def test_a_bad_device_setting_is_one_line_on_every_rank_not_a_hang(name, value):
    proc = tunelab("bench", "allreduce", "--device", "cuda", "--np", "2", "--sizes", "4KiB", "--iters", "1",
                   "--warmup", "0", "--algorithms", "ring", "--no-report", timeout=120,
                   env={"NUMBA_ENABLE_CUDASIM": "1", name: value})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name} must be one of" in lines[0] and repr(value) in lines[0], proc.stderr


def test_bench_allreduce_on_cuda_without_a_device_is_one_clear_error():
    from tunelab.kernels import get_backend

    if get_backend("auto").name != "cpu":
        pytest.skip("this machine has a GPU back end")
    proc = tunelab("bench", "allreduce", "--device", "cuda", "--np", "2", "--no-report", timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda needs a CUDA device" in lines[0], proc.stderr


def test_import_tunelab_stays_light():
    code = ("import sys, tunelab, tunelab.cli, tunelab.knobs, tunelab.config;"
            "heavy = [m for m in ('numba', 'mpi4py', 'torch', 'tensorflow', 'cupy', 'numpy') if m in sys.modules];"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


@pytest.mark.mpi
def test_bench_allreduce_runs_and_writes_nccl_style_json(tmp_path):
    path = tmp_path / "ar.json"
    proc = tunelab("bench", "allreduce", "--np", "2", "--sizes", "4KiB,100KiB", "--dtype", "float32",
                   "--iters", "3", "--warmup", "1", "--json", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    rows = data["rows"]
    algorithms = {r["algorithm"] for r in rows}
    assert {"ring", "hierarchical", "mpi", "bound"} <= algorithms
    for r in rows:
        assert set(r) >= {"algorithm", "size", "count", "dtype", "time_us", "algbw_gbps", "busbw_gbps", "wrong",
                          "time_vs_bound"}
        assert r["wrong"] == 0 and r["time_us"] > 0  # (the bound's copy against its input)
        assert r["time_vs_bound"] == pytest.approx(r["time_us"] / next(
            b["time_us"] for b in rows if b["algorithm"] == "bound" and b["size"] == r["size"]))
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2)
        assert r["algbw_gbps"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
    assert {r["size"] for r in rows} == {4096, 102400}
    assert data["hardware"]["world_size"] == 2 and data["hardware"]["cpu_cores"] >= 1
    assert "busbw_GB/s" in proc.stdout and "#wrong" in proc.stdout and "time/bound" in proc.stdout
    # on one node the two engine rows are one code path: the run says so rather than show two "algorithms"
    assert any("ring and hierarchical run the same code on one node" in n for n in data["notes"]), data["notes"]


@pytest.mark.mpi
def test_bench_allreduce_emulated_nodes_half_precision(tmp_path):
    path = tmp_path / "ar.json"
    proc = tunelab("bench", "allreduce", "--np", "4", "--ranks-per-node", "2", "--sizes", "3KiB",
                   "--dtype", "bfloat16", "--algorithms", "ring,hierarchical,mpi", "--iters", "2",
                   "--warmup", "1", "--json", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert data["hardware"]["nodes"] == 2
    assert not any("same code" in n for n in data["notes"])  # (two nodes of two: hierarchical is its own)
    assert [r["algorithm"] for r in data["rows"]] == ["ring", "hierarchical"]
    assert all(r["wrong"] == 0 for r in data["rows"])
    assert "MPI has no standard bfloat16 sum" in proc.stdout


@pytest.mark.mpi
def test_bench_allreduce_on_nodes_of_unequal_size_leaves_hierarchical_out_unless_asked_for(tmp_path):
    path = tmp_path / "ar.json"
    args = ("bench", "allreduce", "--np", "3", "--ranks-per-node", "2", "--sizes", "4KiB", "--iters", "2",
            "--warmup", "1", "--no-report")
    proc = tunelab(*args, "--json", str(path))
    assert proc.returncode == 0, proc.stderr  # (the default algorithms failed here: no row at all)
    assert [r["algorithm"] for r in json.loads(path.read_text())["rows"]] == ["ring", "mpi", "gloo", "bound"]
    assert "hierarchical: skipped, nodes of unequal size [2, 1]" in proc.stdout
    asked = tunelab(*args, "--algorithms", "ring,hierarchical")
    assert asked.returncode == 2 and "needs the same number of ranks on every node" in asked.stderr


@pytest.mark.mpi
def test_bench_fusion_reports_three_modes_and_the_bound(tmp_path):
    path = tmp_path / "fu.json"
    proc = tunelab("bench", "fusion", "--np", "2", "--iters", "1", "--warmup", "0", "--json", str(path),
                   "--no-report", "--knob", "fusion_threshold_bytes=off")
    assert proc.returncode == 0, proc.stderr
    assert "fusion_threshold=off " in proc.stdout.splitlines()[0]  # (as every command prints knobs)
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert data["hardware"]["world_size"] == 2 and data["hardware"]["cpu_cores"] >= 1  # (as every benchmark's)
    assert [r["mode"] for r in rows] == ["per-tensor", "fused", "contiguous", "bound"]
    assert [r["tensors"] for r in rows] == [161, 161, 1, 1]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["bytes"] == 25_557_032 * 4 for r in rows)
    assert rows[3]["vs_bound"] == 1.0 and rows[2]["vs_bound"] == rows[2]["time_us"] / rows[3]["time_us"]
    assert "vs_bound" in proc.stdout and any(line.split()[:1] == ["bound"] for line in proc.stdout.splitlines())


@pytest.mark.mpi
def test_rank_errors_reach_the_user_as_one_line():
    proc = tunelab("bench", "allreduce", "--np", "2", "--ranks-per-node", "3", "--sizes", "1KiB",
                   "--iters", "1", "--warmup", "0", "--no-report")
    assert proc.returncode == 2  # the layout asked for does not fit the ranks launched: a usage error
    assert proc.stderr.strip().splitlines()[-1].startswith("tunelab: error:")
    assert "ranks_per_node=3 but only 2 ranks share host" in proc.stderr


def test_a_failed_jobs_error_line_survives_lost_stderr(monkeypatch):
    """A rank that fails leaves its line beside the result, because MPI_Abort may tear the job down
    before its stderr is forwarded: run_job reports that line even when stderr carries nothing."""
    from tunelab import launch
    from tunelab.errors import TunelabError
    from tunelab.rankmain import _leave_error

    launch.mpiexec_command()  # found (and cached) before the launch is replaced
    def job_whose_stderr_was_lost(cmd, env, err, banner, timeout_s):
        _leave_error(cmd[-1], 1, "tunelab: error: rank 1: boom\n")  # cmd[-1]: the result path
        return 1

    monkeypatch.setattr(launch, "_run_forwarding", job_whose_stderr_was_lost)
    with pytest.raises(TunelabError, match="^rank 1: boom$"):
        launch.run_job("bench-allreduce", {}, 2)


def test_an_output_that_cannot_be_written_loses_nothing(tmp_path):
    from tunelab.errors import TunelabError
    from tunelab.files import unwritable, write_text

    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    target = blocker / "sub" / "result.json"  # its folder cannot be made: a file is in the way
    assert "is not a directory" in unwritable(target)
    with pytest.raises(TunelabError, match=r"cannot write .*result\.json: .*saved to (\S+)$") as info:
        write_text(target, '{"rows": [1, 2]}\n')
    saved = Path(str(info.value).rsplit(" ", 1)[-1])
    assert json.loads(saved.read_text()) == {"rows": [1, 2]}
    saved.unlink()
    good = tmp_path / "new" / "dir" / "out.json"
    assert unwritable(good) is None and write_text(good, "x") == good and good.read_text() == "x"
    assert [p.name for p in good.parent.iterdir()] == ["out.json"]  # no temporary file left behind


def test_a_reader_that_goes_away_stops_the_command_quietly():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output buffered, flushed at the end
    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "hw"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()  # as `tunelab hw | head -0` would: nobody reads what it prints
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == "", err


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("TUNELAB_SEGMENT_BYTES", "12XB", "knob segment_bytes must be a number"),
    ("TUNELAB_TIMEOUT_S", "abc", "timeout_s must be a number > 0"),
    ("TUNELAB_STALL_WARNING_S", "0", "stall_warning_s must be a number > 0"),
    ("TUNELAB_RANKS_PER_NODE", "0", "ranks_per_node"),
])
def test_a_bad_environment_variable_is_named_in_one_line_and_a_usage_error(name, value, fragment):
    proc = tunelab("bench", "allreduce", "--np", "2", "--sizes", "1KiB", "--no-report", timeout=60, env={name: value})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name}={value!r}: " in lines[0] and fragment in lines[0], proc.stderr


def test_python_dash_m_tunelab_and_hw_read_as_people_read():
    version = subprocess.run([sys.executable, "-m", "tunelab", "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert version.returncode == 0 and version.stdout.startswith("tunelab ")
    hw = tunelab("hw", timeout=120)
    assert hw.returncode == 0, hw.stderr
    lines = dict(line.split(": ", 1) for line in hw.stdout.strip().splitlines())
    assert re.fullmatch(r"[\d.]+ [KMG]iB", lines["memory"]) and "gpu_count" in lines and "frameworks" in lines
    assert "  " not in lines.get("mpi_library", "")  # one line, not MPI's padded banner


def test_human_size_against_hand_written_spellings():
    from tunelab.units import human_size

    cases = {600: "600 B", 1024: "1 KiB", 1536: "1.5 KiB", 102228128: "97.5 MiB", 3 << 30: "3 GiB",
             1023 << 10: "1023 KiB", 5 << 40: "5 TiB",
             # three digits that round up to 1000 are the whole number, not "1e+03 MiB"
             int(999.7 * 2 ** 20): "1000 MiB", int(999.3 * 2 ** 20): "999 MiB"}
    assert {n: human_size(n) for n in cases} == cases


def test_an_output_through_a_link_or_to_a_device_is_written_where_it_points(tmp_path):
    from tunelab.files import unwritable, write_text

    target = tmp_path / "target.json"
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"  # the link stays a link
    write_text(target, "newer")
    assert target.read_text() == "newer" and (target.stat().st_mode & 0o777) == 0o600  # its mode kept
    assert unwritable(Path(os.devnull)) is None
    write_text(Path(os.devnull), "discarded")
    assert Path(os.devnull).exists() and not Path(os.devnull).is_file()  # still the device


def test_every_option_of_every_command_says_what_it_does():
    """``--help`` explains each flag: an option added without a help string is listed here."""
    from tunelab.cli import build_parser

    silent = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and action.help is None:
                silent.append(" ".join([*path, action.option_strings[-1]]))

    walk(build_parser(), ["tunelab"])
    assert not silent, f"options without a help string: {', '.join(silent)}"


def test_only_the_rank_that_writes_outputs_checks_where_they_go(monkeypatch):
    """Inside the user's mpiexec rank 0 alone writes --json and the report: another host's rank need not
    be able to write there (refused, it would now end the whole job)."""
    import argparse

    from tunelab.cli.types import output_file

    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    assert output_file("/proc/no/such/out.json") == Path("/proc/no/such/out.json")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write"):
        output_file("/proc/no/such/out.json")


def test_a_killed_commands_job_folder_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    """A `tune` killed with SIGKILL left its job folder (result, error lines, stderr) in /tmp for good."""
    import tempfile

    from tunelab.launch import JOB_FOLDER_OWNER, JOB_FOLDER_PREFIX, remove_stale_job_folders

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folders = {}
        space = os.readlink("/proc/self/ns/pid")
        for name, owner in (("dead", f"{dead.pid} {space}"), ("alive", f"{alive.pid} {space}"), ("unmarked", None),
                            ("garbled", "x"), ("elsewhere", f"{dead.pid} pid:[1]")):
            folders[name] = tmp_path / f"{JOB_FOLDER_PREFIX}{name}"
            folders[name].mkdir()
            (folders[name] / "stderr.txt").write_text("lines")
            if owner is not None:
                (folders[name] / JOB_FOLDER_OWNER).write_text(owner)
        other = tmp_path / "tunelab-test-x"  # (not a job's folder: never touched)
        other.mkdir()
        (other / JOB_FOLDER_OWNER).write_text(str(dead.pid))
        remove_stale_job_folders()
        assert {n for n, f in folders.items() if f.exists()} == {"alive", "unmarked", "garbled", "elsewhere"}
        assert other.exists()
    finally:
        alive.kill()
        alive.wait()
