"""Bad input found by an audit of every command: one line, the right exit status, nothing destroyed, no hang."""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scenario_text import tiny_replay

DATA = Path(__file__).parent / "data"
LANDSCAPES = Path(__file__).resolve().parents[1] / "tunelab" / "bench" / "landscapes"


def tunelab(*args, timeout=120, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], capture_output=True, text=True, check=False,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


def damaged_copy(source, change, folder, name="input.json"):
    """A copy of the JSON file ``source`` in ``folder``, changed by ``change(doc)``."""
    doc = json.loads(Path(source).read_text())
    change(doc)
    path = folder / name
    path.write_text(json.dumps(doc))
    return path


def one_line_error(proc, status, fragment):
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert fragment in lines[0], lines[0]


# ---- outputs never overwrite what the command reads -----------------------------------------------------
def test_an_output_naming_an_input_is_refused_and_the_input_kept(tmp_path):
    bench = tmp_path / "bench.json"
    shutil.copy(DATA / "report-allreduce.json", bench)
    before = bench.read_bytes()
    one_line_error(tunelab("model", "fit", str(bench), "--out", str(bench)), 2, "is also an input of this command")
    one_line_error(tunelab("report", "--bench", str(bench), "--out", str(bench)), 2, "writing it would destroy it")
    land = tmp_path / "land.json"
    shutil.copy(LANDSCAPES / "replay-bert-2ranks.json", land)
    one_line_error(tunelab("bench", "tuner", "--landscape", str(land), "--json", str(land), "--seeds", "1"), 2,
                   "(--landscape)")
    assert bench.read_bytes() == before
    assert json.loads(land.read_text())["points"]
    one_line_error(tunelab("model", "fit", str(bench), "--out", str(tmp_path / "m.json"), "--json",
                           str(tmp_path / "m.json")), 2, "name the same file")


def test_an_output_naming_an_input_given_by_name_is_refused_and_the_input_kept(tmp_path):
    """A scenario or a landscape named (not given as a path) is an input too: an output onto its file
    (a shipped one's, or a file of that name here) is refused before any work, and the file is kept."""
    scenario = tmp_path / "myscen"  # a scenario name that is no shipped one reads the file of that name here
    scenario.write_text((Path(__file__).resolve().parents[1] / "scenarios" / "replay-vgg16.toml").read_text())
    before = scenario.read_bytes()
    model = tmp_path / "m.json"
    model.write_text("{}")
    for args, flag in [(["tune", "--model", "myscen", "--json", "myscen"], "(--model)"),
                       (["bench", "landscape", "--model", "myscen", "--json", "myscen"], "(--model)"),
                       (["model", "predict", "--model-file", str(model), "--hosts", "2", "--ranks-per-host", "1",
                         "--scenario", "myscen", "--json", "myscen"], "(--scenario)")]:
        one_line_error(tunelab(*args, cwd=tmp_path, env={"TUNELAB_HOME": str(tmp_path / "home")}), 2, flag)
    assert scenario.read_bytes() == before
    shipped = LANDSCAPES / "replay-bert-2ranks.json"
    kept = shipped.read_bytes()
    try:
        one_line_error(tunelab("bench", "tuner", "--landscape", "replay-bert-2ranks", "--json", str(shipped),
                               "--seeds", "1", "--strategies", "tunelab", "--no-report"), 2, "(--landscape)")
    finally:
        if shipped.read_bytes() != kept:  # put the shipped recording back before failing
            shipped.write_bytes(kept)
            pytest.fail("bench tuner overwrote the shipped landscape it read")


@pytest.mark.parametrize("args, env", [
    (["tune", "--scenario", "~nosuchuser/my.toml", "--no-store"], {}),
    (["bench", "landscape", "--model", "~nosuchuser/x.toml"], {}),
    (["profiles", "list"], {"TUNELAB_HOME": "~nosuchuser/tunelab"}),
])
def test_a_tilde_of_an_unknown_user_is_a_usage_error_not_a_traceback(tmp_path, args, env):
    env = {"TUNELAB_HOME": str(tmp_path / "home"), **env}
    one_line_error(tunelab(*args, env=env), 2, "no such user as '~nosuchuser' to expand")


def test_an_output_onto_what_a_command_reads_by_default_is_refused(tmp_path):
    """Left out, --landscape reads every shipped landscape and tune's --model the resnet50 scenario: an
    output onto one of those is refused too, and the file is kept."""
    root = Path(__file__).resolve().parents[1]
    cases = [(LANDSCAPES / "replay-bert-2ranks.json",
              ["bench", "tuner", "--seeds", "1", "--strategies", "tunelab", "--no-report", "--json"], "(--landscape)"),
             (root / "scenarios" / "resnet50.toml", ["tune", "--no-store", "--json"], "(--model)"),
             (root / "scenarios" / "replay-resnet50.toml",
              ["bench", "tuner", "--model-file", str(tmp_path / "m.json"), "--no-report", "--json"], "(--scenario)")]
    for target, args, flag in cases:
        kept = target.read_bytes()
        try:
            one_line_error(tunelab(*args, str(target), env={"TUNELAB_HOME": str(tmp_path / "home")}), 2, flag)
        finally:
            if target.read_bytes() != kept:  # put the shipped file back before failing
                target.write_bytes(kept)
                pytest.fail(f"{' '.join(args[:2])} overwrote {target}, which it reads by default")
    # tune reads $TUNELAB_HOME/scale-model.json where it exists and --model-file is left out
    home = tmp_path / "home2"
    home.mkdir()
    model = home / "scale-model.json"
    model.write_text('{"a fitted": "model"}')
    one_line_error(tunelab("tune", "--no-store", "--no-report", "--json", str(model), env={"TUNELAB_HOME": str(home)}),
                   2, "(--model-file)")
    assert model.read_text() == '{"a fitted": "model"}'


def test_an_output_onto_a_default_that_another_flag_replaces_is_not_refused(tmp_path):
    """tune with --scenario does not read the resnet50 scenario, nor bench tuner with --model-file the
    shipped landscapes: an output there is the user's to write (checked without running the command)."""
    from tunelab import cli
    from tunelab.errors import UsageError

    root = Path(__file__).resolve().parents[1]
    mine = tmp_path / "mine.toml"
    mine.write_text((root / "scenarios" / "resnet50.toml").read_text())
    shipped_scenario, shipped_landscape = root / "scenarios" / "resnet50.toml", LANDSCAPES / "replay-bert-2ranks.json"

    def check(*argv):
        args, _ = cli.build_parser().parse_known_args(list(argv))
        cli._refuse_overwriting_inputs(args)

    check("tune", "--scenario", str(mine), "--json", str(shipped_scenario))
    check("bench", "tuner", "--model-file", str(tmp_path / "m.json"), "--json", str(shipped_landscape))
    with pytest.raises(UsageError, match="--model"):
        check("tune", "--json", str(shipped_scenario))
    with pytest.raises(UsageError, match="--scenario"):
        check("tune", "--scenario", str(mine), "--json", str(mine))


def test_a_scenario_by_name_and_by_file_at_once_is_a_usage_error(tmp_path):
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "resnet50.toml"
    for command in ("tune", "bench landscape"):
        one_line_error(tunelab(*command.split(), "--model", "resnet50", "--scenario", str(scenario),
                               env={"TUNELAB_HOME": str(tmp_path)}), 2, "not allowed with argument --model")


def test_an_export_onto_the_profile_store_is_refused(tmp_path):
    store = tmp_path / "profiles.sqlite"
    store.write_bytes(b"not touched")
    proc = tunelab("profiles", "export", "--out", str(store), env={"TUNELAB_HOME": str(tmp_path)})
    one_line_error(proc, 2, "is also the profile store")
    assert store.read_bytes() == b"not touched"


# ---- link speeds and sizes a run or a prediction cannot take -----------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (["bench", "allreduce", "--np", "2", "--ranks-per-node", "1", "--link-gbps", "1e-8"], "0.001 .. 100000 Gb/s"),
    (["bench", "allreduce", "--link-latency-us", "1e12"], "a link latency must be 0 .. 1e+06 us"),
    (["model", "predict", "--model-file", "m.json", "--hosts", "2", "--ranks-per-host", "1", "--link-gbps", "inf"],
     "0.001 .. 100000 Gb/s"),
    (["model", "predict", "--model-file", "m.json", "--hosts", "2", "--ranks-per-host", "1",
      "--oversubscription", "inf"], "expected a positive number"),
    (["bench", "tuner", "--model-file", "m.json", "--link-gbps", "1e-300"], "0.001 .. 100000 Gb/s"),
])
def test_link_speeds_outside_what_runs_are_usage_errors(args, fragment):
    one_line_error(tunelab(*args), 2, fragment)


def test_an_emulated_link_without_emulated_nodes_is_a_usage_error():
    proc = tunelab("bench", "allreduce", "--np", "2", "--sizes", "4KiB", "--iters", "1", "--no-report",
                   env={"TUNELAB_LINK_GBPS": "1"}, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "link_gbps emulates the link between emulated nodes: set ranks_per_node too" in proc.stderr


def test_a_tiny_link_speed_from_the_environment_is_refused(tmp_path):
    proc = tunelab("bench", "allreduce", "--np", "2", "--sizes", "4KiB", "--iters", "1", "--no-report",
                   env={"TUNELAB_RANKS_PER_NODE": "1", "TUNELAB_LINK_GBPS": "1e-9"}, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "TUNELAB_LINK_GBPS" in proc.stderr and "0.001 .. 100000 Gb/s" in proc.stderr


def test_tuning_one_rank_is_a_usage_error(tmp_path):
    """One rank's gradients are their own allreduce (the optimizers send nothing): nothing to tune, so
    tune says so before launching anything, and writes no store."""
    proc = tunelab("tune", "--model", "resnet50", "--np", "1", env={"TUNELAB_HOME": str(tmp_path)})
    one_line_error(proc, 2, "tune needs 2 or more ranks")
    assert not any(tmp_path.iterdir())


# ---- model files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model.json"
    proc = tunelab("model", "fit", str(DATA / "report-allreduce.json"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d["values"].update(gamma="abc"), "parameter gamma is 'abc'"),
    (lambda d: d["values"].update(gamma=[1]), "parameter gamma is [1]"),
    (lambda d: d["values"].update(gamma=-1.0), "not a number >= 0"),
    (lambda d: d.update(values={}), "has no parameters"),
    (lambda d: d.update(points="x"), "points is not int"),
    (lambda d: d.update(sources=5), "sources is not list"),
    (lambda d: d.update(rel_errors=[1, 2]), "rel_errors is not dict"),
    (lambda d: d.update(points=-5), "points is not a count of 0 .. 1e9"),
    (lambda d: d.update(points=10 ** 400), "points is not a count of 0 .. 1e9"),  # (printed as 401 digits)
    (lambda d: d.update(sources=[1, None]), "sources are not all file names"),
    (lambda d: d.update(rel_errors={"median": "abc"}), "rel_errors are not all numbers >= 0"),
    (lambda d: d["values"].update({"link:0gbps.beta": 1e-9}), "link 0gbps is not a speed > 0"),
    # values past any fit: predictions of 1e298 s, inf in the tables and the crossover scan
    (lambda d: d["values"].update(gamma=1e300), "parameter gamma is 1e+300, more than any fit gives"),
    (lambda d: d["values"].update({"link.alpha": 1e300}), "parameter link.alpha is 1e+300, more than any fit"),
    # the report plots the fitted points: a damaged one was a traceback after the tables
    (lambda d: d.update(fit_points=[5]), "fit_points[0] is int, not an object"),
    (lambda d: d["fit_points"][1].update(measured_s="x"), "fit_points[1] has no time > 0 for measured_s"),
    (lambda d: d["fit_points"][0].pop("algorithm"), "fit_points[0] has no text algorithm"),
])
def test_a_damaged_model_file_is_named_in_one_line(model_file, tmp_path, change, fragment):
    bad = damaged_copy(model_file, change, tmp_path)
    proc = tunelab("model", "predict", "--model-file", str(bad), "--hosts", "1", "--ranks-per-host", "2",
                   "--no-report")
    one_line_error(proc, 2, fragment)


def test_prediction_sizes_and_checks_are_refused_before_any_table(model_file, tmp_path):
    proc = tunelab("model", "predict", "--model-file", str(model_file), "--hosts", "1000000000",
                   "--ranks-per-host", "1000000000", timeout=60)
    one_line_error(proc, 2, "the model predicts up to")
    for extra, fragment in ((["--scenario", "no-such-scenario"], "no scenario named"),
                            (["--check", str(tmp_path / "missing.json")], "no such file"),
                            (["--check-sizes", "1MiB"], "give --check too"),
                            (["--check", str(DATA / "report-allreduce.json"), "--check-sizes", "3KiB"],
                             "--check: no measurement at the sizes given (3KiB)")):
        proc = tunelab("model", "predict", "--model-file", str(model_file), "--hosts", "1", "--ranks-per-host", "2",
                       "--no-report", *extra)
        one_line_error(proc, 2, fragment)
        assert proc.stdout.strip() == "", proc.stdout  # refused before a table was printed
    for extra, fragment in ((["--hosts", "1", "--ranks-per-host", "1"], "one rank has nothing to reduce"),
                            (["--hosts", "2", "--ranks-per-host", "2", "--oversubscription", "1e300"],
                             "expected at most 1024 ranks a core"),
                            # fitted on runs with a core per rank: it cannot say what two ranks a core cost
                            (["--hosts", "1", "--ranks-per-host", "2", "--oversubscription", "2"], "no fitted"),
                            (["--hosts", "1", "--ranks-per-host", "2", "--link-gbps", "10"],
                             "--link-gbps is the link between hosts, and --hosts 1 has none")):
        proc = tunelab("model", "predict", "--model-file", str(model_file), "--no-report", *extra)
        one_line_error(proc, 2, fragment)
        assert proc.stdout.strip() == "", proc.stdout


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d["rows"][0].update(time_us=float("inf")), "its time 1 ns .. 1e6 s"),
    (lambda d: d["rows"][0].update(time_us=1e-300), "its time 1 ns .. 1e6 s"),  # (the fit's solver met inf)
    (lambda d: d["hardware"].update(nodes=10 ** 12, ranks_per_node=2), "nodes must be 1 .. world_size"),  # (a list of 1e12 hosts)
    (lambda d: d["rows"][0].update(size=1e300), "a row's size must be 1 B .. 1 PiB"),
    (lambda d: d["hardware"].update(ranks_per_machine="x"), "hardware ranks_per_machine must be a whole number"),
    (lambda d: d["hardware"].update(ranks_per_machine=1e15), "hardware ranks_per_machine must be a whole number"),
    (lambda d: d["hardware"].update(cpu_cores=-2), "hardware cpu_cores must be a whole number from 0"),
    (lambda d: d["hardware"].update(cpu_cores=0.001), "hardware cpu_cores must be a whole number from 0"),
    (lambda d: d["hardware"].update(link_latency_us="50"), "hardware link_latency_us must be a number"),
    (lambda d: d["hardware"].update(nodes=2, ranks_per_node=[1, 1], link_gbps=True), "hardware link_gbps must be"),
    (lambda d: d["hardware"].update(nodes=2, ranks_per_node=[1, 1], lab={"link_gbps": 1, "burst_bytes": float("nan")}),
     "hardware lab.burst_bytes must be a number from 0"),
    (lambda d: d["hardware"].update(nodes=-1), "hardware facts unusable"),
    (lambda d: d["hardware"].update(nodes=2, ranks_per_node=[1, 1], link_gbps=-5), "a link speed must be"),
    (lambda d: d["hardware"].update(nodes=2, ranks_per_node=[1, 1], link_gbps="fast"), "hardware link_gbps must be"),
    (lambda d: d.update(hardware=None), "its hardware facts"),
    (lambda d: d["rows"][0].update(algorithm=7), "row 1: algorithm must be a name, got 7"),
    (lambda d: d["rows"][1].update(time_us="slow"), "row 2 (hierarchical): size and time_us must be numbers"),
    (lambda d: d["rows"][0].update(size=float("inf")), "size and time_us must be numbers (a whole number"),
    (lambda d: d["rows"][0].update(size=1.7), "size and time_us must be numbers (a whole number"),
    (lambda d: d["rows"][0].update(time_us=True), "size and time_us must be numbers"),
    (lambda d: d["rows"][0].update(time_us=10 ** 400), "size and time_us must be numbers"),
    (lambda d: d["hardware"].update(world_size=float("inf")), "hardware facts unusable (OverflowError"),
    (lambda d: d["hardware"].update(world_size=1 << 22), "world_size must be 1 .. 1048576 ranks"),
    (lambda d: d["hardware"].update(nodes=3, ranks_per_node=[1, 1]), "nodes is 3 but ranks_per_node lists 2"),
])
def test_a_damaged_bench_file_is_not_fitted(tmp_path, change, fragment):
    bad = damaged_copy(DATA / "report-allreduce.json", change, tmp_path)
    out = tmp_path / "model.json"
    one_line_error(tunelab("model", "fit", str(bad), "--out", str(out)), 2, fragment)
    assert not out.exists()


# ---- ranks given different command lines ---------------------------------------------------------------
def test_ranks_given_different_command_lines_stop_with_one_error_instead_of_hanging():
    from tunelab.launch import mpiexec_command

    one = ["tunelab", "bench", "allreduce", "--sizes", "4KiB", "--warmup", "0", "--algorithms", "ring",
           "--no-report"]
    cmd = [*mpiexec_command(), "-n", "1", sys.executable, "-m", "tunelab.cli", *one[1:], "--iters", "1", ":",
           "-n", "1", sys.executable, "-m", "tunelab.cli", *one[1:], "--iters", "3"]
    from tunelab.launch import mpich_segments, remove_orphaned_segments

    segments = mpich_segments()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    finally:
        remove_orphaned_segments(segments)  # the job aborts: its segment would stay in /dev/shm
    assert proc.returncode != 0
    assert "ranks disagree on the command's iters: rank 0 has 1, rank 1 3" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("second", [
    ["bench", "allreduce", "--sizes", "4KiB", "--iters", "0", "--no-report"],  # refused by the parser
    ["tune", "--scenario", "only-on-the-other-host.toml", "--no-store", "--no-report"],  # a file on one host
])
def test_a_rank_refused_before_the_job_starts_ends_the_whole_job(tmp_path, second):
    """Under the user's mpiexec, a rank that stopped at its command line exited alone, and the launcher
    left the other ranks waiting in MPI for ever, spinning: now it ends the job, with its status, and
    leaves no shared memory behind."""
    import time

    from tunelab.launch import mpich_segments, mpiexec_command

    first = ["bench", "allreduce", "--sizes", "4KiB", "--iters", "1", "--warmup", "0", "--algorithms", "ring",
             "--no-report"]
    cmd = [*mpiexec_command(), "-n", "1", sys.executable, "-m", "tunelab.cli", *first, ":",
           "-n", "1", sys.executable, "-m", "tunelab.cli", *second]
    before = mpich_segments()
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
                          env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})
    assert time.monotonic() - start < 60 and proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "tunelab: error:" in proc.stderr or "error: argument --iters" in proc.stderr, proc.stderr[-2000:]
    assert mpich_segments() <= before


_FAILS_ON_RANK_0 = """
import sys
from mpi4py import MPI
from tunelab.tuning import run

if MPI.COMM_WORLD.rank == 0:  # a defect on rank 0 alone, in the middle of the search
    record, calls = run._Recorder.record, []

    def failing(self, sample):
        calls.append(sample)
        if len(calls) == 3:
            raise RuntimeError("injected: rank 0 failed in the middle of the search")
        record(self, sample)

    run._Recorder.record = failing
from tunelab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_whose_job_fails_under_the_users_mpiexec_ends_the_job(tmp_path):
    """Under the user's mpiexec, a rank whose job raised after the ranks agreed on it (an error on that
    rank alone) exited alone: the others waited in the job's next collective for ever, and so did its
    own MPI_Finalize.  Now it ends the job, as a launched job's ranks do."""
    import time

    from tunelab.launch import mpich_segments, mpiexec_command, remove_orphaned_segments

    (tmp_path / "tiny.toml").write_text(tiny_replay(budget=8))
    script = tmp_path / "fails.py"
    script.write_text(_FAILS_ON_RANK_0)
    cmd = [*mpiexec_command(), "-n", "2", sys.executable, str(script), "tune", "--scenario", "tiny.toml",
           "--no-report"]
    before = mpich_segments()
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
                              env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})
    finally:
        remove_orphaned_segments(before)
    assert proc.returncode != 0 and time.monotonic() - start < 90, (proc.returncode, proc.stderr[-2000:])
    assert "injected: rank 0 failed in the middle of the search" in proc.stderr, proc.stderr[-2000:]
    assert mpich_segments() <= before


def test_an_error_every_rank_meets_alike_under_the_users_mpiexec_ends_the_job_without_an_abort(tmp_path):
    """A layout every rank refuses alike, inside the job: each rank exits with its usage error (2), as
    without mpiexec, rather than every rank calling MPI_Abort (the abort banners, lines lost)."""
    from tunelab.launch import mpich_segments, mpiexec_command, remove_orphaned_segments

    before = mpich_segments()
    try:
        proc = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, "-m", "tunelab.cli", "bench",
                               "allreduce", "--ranks-per-node", "3", "--sizes", "4KiB", "--iters", "1",
                               "--no-report"], capture_output=True, text=True, check=False, timeout=120,
                              cwd=tmp_path, env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})
    finally:
        remove_orphaned_segments(before)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "ranks_per_node=3 but only 2 ranks share host" in proc.stderr and "MPI_Abort" not in proc.stderr


def test_under_the_users_mpiexec_the_job_runs_on_its_ranks_and_a_different_np_is_refused(tmp_path):
    """`mpiexec -n 2 tunelab tune` of a scenario of 3 ranks said "on 3 ranks" and tuned on 2; `--np 3`
    was ignored the same way (and `--np 1` refused a job of 2 ranks as one of 1)."""
    from tunelab.launch import mpich_segments, mpiexec_command, remove_orphaned_segments

    (tmp_path / "tiny.toml").write_text(tiny_replay(budget=3, np=3))
    env = {**os.environ, "TUNELAB_HOME": str(tmp_path / "home")}
    base = [*mpiexec_command(), "-n", "2", sys.executable, "-m", "tunelab.cli"]
    before = mpich_segments()
    try:
        ran = subprocess.run([*base, "tune", "--scenario", "tiny.toml", "--no-store", "--no-report"],
                             capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path, env=env)
        refused = [subprocess.run([*base, *words, "--np", "3", "--no-report"], capture_output=True, text=True,
                                  check=False, timeout=120, cwd=tmp_path, env=env)
                   for words in (["tune", "--scenario", "tiny.toml", "--no-store"],
                                 ["bench", "allreduce", "--sizes", "4KiB", "--iters", "1"])]
    finally:
        remove_orphaned_segments(before)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "(replay) on 2 ranks" in ran.stdout, ran.stdout[:2000]
    for proc in refused:
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        assert "--np 3, but the launcher started 2 ranks: leave --np out under mpiexec/srun" in proc.stderr


def test_a_scenario_lab_under_the_users_mpiexec_is_refused_before_any_rank_builds_it(tmp_path):
    """Each rank of `mpiexec -n 2 tunelab tune` of a scenario with a [lab] brought the lab up (as root),
    probed it and took it down, only for the run to be refused then."""
    from tunelab.launch import mpich_segments, mpiexec_command, remove_orphaned_segments

    (tmp_path / "lab.toml").write_text(tiny_replay("tiny-lab", budget=3, np=None, lab="hosts = 2\nlink_gbps = 5"))
    before = mpich_segments()
    try:
        proc = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, "-m", "tunelab.cli", "tune",
                               "--scenario", "lab.toml", "--no-store", "--no-report"], capture_output=True,
                              text=True, check=False, timeout=120, cwd=tmp_path,
                              env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home"),
                                   "TUNELAB_LAB_DIR": str(tmp_path / "lab")})
    finally:
        remove_orphaned_segments(before)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "scenario tiny-lab's [lab] launches its own ranks on the lab's hosts: run it outside mpiexec" \
        in proc.stderr, proc.stderr[-2000:]
    assert "lab" not in proc.stdout and not (tmp_path / "lab").exists()


def test_inside_the_users_mpiexec_rank_0_alone_writes_the_outputs(tmp_path):
    """Every rank has rank 0's result; each wrote its own report, and --json /dev/stdout held the
    document once per rank (not JSON any more)."""
    from tunelab.launch import mpiexec_command

    cmd = [*mpiexec_command(), "-n", "2", sys.executable, "-m", "tunelab.cli", "bench", "allreduce", "--sizes", "4KiB",
           "--iters", "1", "--warmup", "0", "--algorithms", "ring", "--json", "/dev/stdout"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
                          env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    document = proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1]
    assert json.loads(document)["rows"], proc.stdout[-2000:]  # one document
    assert len(list((tmp_path / "reports").glob("*.html"))) == 1


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_a_job_that_aborts_leaves_no_shared_memory_behind():
    def segments():
        return {p.name for p in Path("/dev/shm").glob("mpich_shm_*")}

    before = segments()
    for _ in range(2):  # a rank's error tears the job down with MPI_Abort
        proc = tunelab("bench", "allreduce", "--np", "2", "--sizes", "4KiB", "--iters", "1", "--no-report",
                       env={"TUNELAB_RANKS_PER_NODE": "3"})
        assert proc.returncode == 2 and "ranks_per_node=3" in proc.stderr, proc.stderr[-2000:]
    assert segments() <= before


def test_more_ranks_than_memory_holds_are_refused_before_any_start(tmp_path):
    from tunelab.errors import UsageError
    from tunelab.launch import check_ranks_fit

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8388608 kB\nMemAvailable:  1048576 kB\n")  # 1 GiB available: 8 ranks
    check_ranks_fit(8, meminfo)
    with pytest.raises(UsageError, match="^9 ranks do not fit on this machine: .* 1024 MiB are available "
                                         r"\(at most 8 ranks\)"):
        check_ranks_fit(9, meminfo)
    check_ranks_fit(10**6, tmp_path / "missing")  # nothing to check against: no refusal
    proc = tunelab("bench", "allreduce", "--np", "1000000", "--no-report", cwd=tmp_path)
    one_line_error(proc, 2, "1000000 ranks do not fit on this machine")
    proc = tunelab("tune", "--model", "replay-resnet50", "--np", "1000000", "--no-report", "--no-store", cwd=tmp_path)
    one_line_error(proc, 2, "1000000 ranks do not fit on this machine")
    assert proc.stdout == ""  # refused before the header that would name them


# ---- a rank that dies -----------------------------------------------------------------------------------
HYDRA_BANNER = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 2896 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
"""


def test_the_launchers_banner_for_a_dead_rank_becomes_one_line():
    from tunelab.launch import _LauncherBanner

    banner = _LauncherBanner()
    ours = "a table\n\n=====================  not the launcher's  =====================\n"
    shown = [out for line in ("rank 0 says hi\n", *HYDRA_BANNER.splitlines(keepends=True), *ours.splitlines(True))
             for out in banner.feed(line)] + banner.close()
    assert "".join(shown) == "rank 0 says hi\n" + ours  # what is not the banner passes as it was
    assert banner.describe("tune") == ("tune failed: a rank (pid 2896 on vm) ended with killed (signal 9); "
                                       "the other ranks were stopped")
    plain = _LauncherBanner()  # a rank that exits non-zero: no exit string, the code is named
    for line in HYDRA_BANNER.replace("EXIT CODE: 9", "EXIT CODE: 3").splitlines(keepends=True)[:8]:
        assert plain.feed(line) == []
    assert "ended with exit code 3" in plain.describe("tune") and _LauncherBanner().describe("tune") == ""


def _argv(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # it ended meanwhile
        return []


def _descendants(pid):
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running_job(tmp_path):
    """A launched 2-rank job well into its work, and its ranks' pids."""
    import time

    # Ctrl-C as from a terminal, even where this test runs with SIGINT ignored (a background job)
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'tunelab'; runpy.run_module('tunelab.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, "bench", "allreduce", "--np", "2", "--sizes",
                             "64KiB", "--iters", "1000000", "--warmup", "1", "--algorithms", "ring", "--no-report"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # (a killed launcher's scratch stays there)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = [p for p in _descendants(proc.pid) if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]]
        if len(ranks) == 2:
            time.sleep(3.0)  # into the job
            return proc, ranks
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the job's two ranks did not start")


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finding the ranks needs /proc")
@pytest.mark.parametrize("signame,status,line", [("SIGINT", 130, "tunelab: interrupted"),
                                                 ("SIGTERM", 143, "tunelab: terminated"),
                                                 ("SIGHUP", 129, "tunelab: hung up")])  # (left the ranks)
def test_an_interrupted_launch_stops_its_ranks(tmp_path, signame, status, line):
    import signal
    import time

    proc, ranks = _running_job(tmp_path)
    try:
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (status, line + "\n"), err[-2000:]
    assert "mpiexec@" not in out, out
    time.sleep(1.0)
    alive = [p for p in ranks if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]]
    assert not alive, f"ranks {alive} outlived the command"


@pytest.mark.mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_launch_leaves_no_ranks(tmp_path):
    """SIGKILL runs none of the command's clean-up, and the launcher is in a session of its own: the
    kernel's parent-death signal is what still ends the launcher and so its ranks.  (The MPICH segment
    the job made is left: its clean-up ran in the killed command.  The test removes it.)"""
    import time

    from tunelab.launch import mpich_segments, remove_orphaned_segments

    before = mpich_segments()
    proc, ranks = _running_job(tmp_path)
    try:
        proc.kill()
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            alive = [p for p in ranks if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]]
            if not alive:
                break
            time.sleep(0.2)
    finally:
        for p in ranks:  # (what the test leaves must not slow the tests after it)
            if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]:
                os.kill(p, 9)
        remove_orphaned_segments(before)
    assert not alive, f"ranks {alive} outlived the killed command by 5 s"


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="MPICH's segments live in /dev/shm")
def test_the_next_launch_removes_segments_a_killed_job_left_and_no_other():
    """Unmapped and older than five minutes: a segment a job killed with its command left (removed);
    a new one (a job starting now) and an old one a process maps (a job running) are left alone."""
    import mmap
    import time

    from tunelab.launch import remove_stale_segments

    tag = f"{os.getpid()}_test"
    stale, fresh, held = (Path(f"/dev/shm/mpich_shm_{tag}_{k}") for k in ("stale", "fresh", "held"))
    try:
        for path in (stale, fresh, held):
            path.write_bytes(b"\0" * 4096)
        for path in (stale, held):
            past = time.time() - 600
            os.utime(path, (past, past))
        with open(held, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
            remove_stale_segments()
            assert mapped[0] == 0
        assert (stale.exists(), fresh.exists(), held.exists()) == (False, True, True)
    finally:
        for path in (stale, fresh, held):
            path.unlink(missing_ok=True)


@pytest.mark.mpi
def test_a_reader_that_goes_away_stops_the_launched_job(tmp_path):
    """``tunelab tune | head -2``: once nobody reads the ranks' progress, the job stops (rather than run
    to its end with its output going nowhere), quietly, with the status of a broken pipe."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "tune", "--model", "replay-resnet50", "--budget",
                             "200", "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env)
    try:
        first = [proc.stdout.readline() for _ in range(2)]
        ranks = [p for p in _descendants(proc.pid) if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]]
        proc.stdout.close()  # as head does after its lines
        _, err = proc.communicate(timeout=120)  # the budget of 200 blocks would take many minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first[0].startswith("# tuning replay-resnet50") and "explore" in first[1], first
    assert (proc.returncode, err) == (141, ""), err[-2000:]
    assert len(ranks) == 2 and not [p for p in ranks if _argv(p)[1:3] == [b"-m", b"tunelab.rankmain"]]
    from tunelab.profiles import ProfileStore

    store = ProfileStore(create=False)  # every measured block is stored as it ends: how far did the job go?
    blocks = sum(len(store.trials(p.id)) for p in store.profiles())
    assert 1 <= blocks < 30, f"{blocks} of the budget's 200 blocks ran after the reader went away"


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finding the ranks needs /proc")
def test_a_killed_rank_stops_the_job_with_one_line(tmp_path):
    import signal

    proc, ranks = _running_job(tmp_path)
    try:
        os.kill(ranks[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "BAD TERMINATION" not in out and "FAQ" not in out, out[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "ended with killed (signal 9)" in lines[0], err[-2000:]


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d.update(discard_steps="x"), "discard_steps must be an integer from 0 to 100000"),
    (lambda d: d.update(measure_steps=0), "measure_steps must be an integer from 1 to 100000"),
    (lambda d: d.update(measure_steps=10 ** 12), "measure_steps must be an integer from 1 to 100000"),
    (lambda d: d["points"][0].update(steps_s=[[1e-300] * 3]), "every step time one from 1e-09 to 1e+06 s"),
    (lambda d: d["points"][0].update(steps_s=[[1e300] * 3]), "every step time one from 1e-09 to 1e+06 s"),
    (lambda d: d["points"][0].update(scores=[1e308]), "a score that is not a positive number up to 1e+12"),
    (lambda d: d["points"][1].update(steps_s=[]), "point 1 has no recorded steps, and others have"),
    (lambda d: d.update(block_seconds=-1), "block_seconds must be a positive number of seconds"),
    (lambda d: d["space"].update(names=["nope"]), "space.names has 'nope'"),
    (lambda d: d["space"].update(names="segment_bytes"), "space.names is not a list of knob names"),
    (lambda d: d.update(scenario=5), "scenario must be a scenario's name"),
    (lambda d: d.update(samples_per_step=1e308), "samples_per_step must be a number in (0, 1e6]"),
    (lambda d: d["space"].update(names=["hierarchical"]), "no point has hierarchical=True"),
])
def test_a_damaged_landscape_is_a_usage_error(tmp_path, change, fragment):
    bad = damaged_copy(LANDSCAPES / "replay-bert-2ranks.json", change, tmp_path)
    one_line_error(tunelab("bench", "tuner", "--landscape", str(bad), "--seeds", "1", "--strategies", "tunelab",
                           "--no-report"), 2, fragment)
    one_line_error(tunelab("bench", "tuner", "--landscape", str(bad), "--seeds", "1", "--strategies", "tunelab",
                           "--no-report"), 2, f"landscape {bad}:")  # the file as given, not its stem


@pytest.mark.parametrize("kind,source,change", [
    ("--bench", "report-allreduce.json", lambda d: d.update(hardware=["not", "an", "object"])),
    ("--tune", "report-tune.json", lambda d: d.update(locked_final=[1, 2])),
    ("--tune", "report-tune.json", lambda d: d["samples"][0].update(spread="x")),
])
def test_a_malformed_report_input_is_named_in_one_line(tmp_path, kind, source, change):
    bad = damaged_copy(DATA / source, change, tmp_path)
    out = tmp_path / "report.html"
    one_line_error(tunelab("report", kind, str(bad), "--out", str(out)), 2, f"{kind} {bad}: malformed input")
    assert not out.exists()


@pytest.mark.parametrize("kind,source,change,fragment", [
    # (1e309 is read back as inf: a report of "inf", or numpy's warning lines before a ValueError)
    ("--tune", "report-tune.json", lambda d: d["default"].update(score=1e309), "the default of this tune result"),
    ("--tune", "report-tune.json", lambda d: d["samples"][0].update(score=1e309), "sample 1 of this tune result"),
    ("--tune", "report-tune.json", lambda d: d["best"].update(score=1e309), "the best of this tune result"),
    ("--bench", "report-allreduce.json", lambda d: [r.update(size=0) for r in d["rows"]],  # (a log axis)
     "size must be > 0 bytes, got 0"),
])
def test_a_report_input_with_a_number_it_cannot_draw_is_named_in_one_line(tmp_path, kind, source, change, fragment):
    bad = damaged_copy(DATA / source, change, tmp_path)
    out = tmp_path / "report.html"
    one_line_error(tunelab("report", kind, str(bad), "--out", str(out)), 2, fragment)
    assert not out.exists()


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d.update(gain_interval="1.1x"), "gain_interval must be null or an object with numbers gain, low and high"),
    (lambda d: d.update(gain_interval={"gain": 1.1, "low": 1.2, "high": 1.3}), "gain_interval must have 0 < low <= gain"),
    (lambda d: d.update(gain_interval=None, runner_up={"knobs": {}, "score": 1.0, "interval": [1, 2]}),
     "runner_up.interval must be null or an object"),
    (lambda d: d.update(gain_interval=None, drift=[1.0]), "drift must be an object"),
    (lambda d: d["locked_final"].update(default_recent={"score": -1, "blocks": 2}),
     "locked_final.default_recent must be null or an object with a positive score"),
])
def test_a_tune_result_with_a_damaged_interval_is_named_by_its_field(tmp_path, change, fragment):
    bad = damaged_copy(DATA / "report-tune.json", change, tmp_path)
    out = tmp_path / "report.html"
    one_line_error(tunelab("report", "--tune", str(bad), "--out", str(out)), 2, fragment)
    assert not out.exists()


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d.update(version=0), '"version" must be 1 .. 2'),
    (lambda d: d["profiles"][0]["trials"][0]["knobs"].update(bogus=1), "trials[0].knobs: unknown knob 'bogus'"),
    (lambda d: d["profiles"][0]["best"]["knobs"].update(segment_bytes=1), "best.knobs: knob segment_bytes=1"),
    (lambda d: d["profiles"][0]["trials"][0].update(steps=10 ** 30), "trials[0].steps must be a finite number"),
    (lambda d: d["profiles"][0].update(world_size=10 ** 30), "world_size must be a finite number"),
    (lambda d: d["profiles"][0].update(hardware_facts={"x": float("nan")}), "NaN or infinity"),
])
def test_an_export_that_a_store_could_not_use_is_refused_before_anything_is_written(tmp_path, change, fragment):
    bad = damaged_copy(DATA / "report-profile-export.json", change, tmp_path)
    home = tmp_path / "home"
    one_line_error(tunelab("profiles", "import", str(bad), env={"TUNELAB_HOME": str(home)}), 2, fragment)
    listing = tunelab("profiles", "list", env={"TUNELAB_HOME": str(home)})
    assert listing.returncode == 0 and "resnet" not in listing.stdout


def test_a_damaged_trial_in_the_store_names_its_profile(tmp_path):
    import sqlite3

    home = tmp_path / "home"
    assert tunelab("profiles", "import", str(DATA / "report-profile-export.json"),
                   env={"TUNELAB_HOME": str(home)}).returncode == 0
    with sqlite3.connect(home / "profiles.sqlite") as conn:
        conn.execute("UPDATE trials SET score = 'abc' WHERE id = (SELECT MIN(id) FROM trials)")
    proc = tunelab("report", "--profile", "1", "--out", str(tmp_path / "r.html"), env={"TUNELAB_HOME": str(home)})
    one_line_error(proc, 1, "profile 1 is damaged (the score of its trial")
    assert "profiles delete 1" in proc.stderr


def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path):
    if Path("/proc/self").is_dir():
        one_line_error(tunelab("bench", "kernels", "--sizes", "4KiB", "--iters", "1", "--json", "/proc/x/y.json"), 2,
                       "/proc is not writable")
    link = tmp_path / "dangling.json"
    link.symlink_to(tmp_path / "no-such-folder" / "out.json")
    one_line_error(tunelab("bench", "kernels", "--sizes", "4KiB", "--iters", "1", "--json", str(link)), 2,
                   "which cannot be created")
    (tmp_path / "reports").write_text("a file where the reports folder goes")
    proc = tunelab("bench", "kernels", "--sizes", "4KiB", "--iters", "1", cwd=tmp_path)
    one_line_error(proc, 2, "cannot write reports under reports/")
    assert proc.stdout == ""  # refused before the benchmark ran


@pytest.mark.parametrize("args,fragment", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "allreduce", "--json", ""], "argument --json: an empty path"),
    (["bench", "kernels", "--sizes", "3", "--no-report"], "size 3 must be a multiple of 4 bytes"),
    (["tune", "--model-file", ".", "--no-report"], "not a model file"),
    (["tune", "--model", "", "--no-report"], "an empty scenario name; shipped scenarios are"),
    (["tune", "--scenario", "", "--no-report"], "argument --scenario: an empty path"),
    (["bench", "landscape", "--scenario", ""], "argument --scenario: an empty path"),
    (["report", "--bench", ""], "argument --bench: an empty path"),
    (["model", "fit", ""], "an empty path"),
    (["tune", "--seed", str(2**32)], "argument --seed: expected an integer from 0 to 2147483647"),
    (["tune", "--model", "x" * 300, "--no-report"], "file name too long"),
    (["bench", "allreduce", "--np", "1", "--json", "x" * 300 + ".json"], "file name too long"),
    (["bench", "kernels", "--backend", "cpu", "--sizes", "1000GiB", "--no-report"], "does not fit in memory here"),
    # (a size the allocator lets through got the ranks killed by the kernel, with no error said)
    (["bench", "allreduce", "--np", "2", "--sizes", "1KiB,1000GiB", "--no-report"], "on 2 ranks does not fit in memory"),
])
def test_more_bad_flags_are_usage_errors(args, fragment):
    one_line_error(tunelab(*args), 2, fragment)


def test_a_lab_directory_that_is_a_file_or_holds_a_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    one_line_error(tunelab("lab", "down", env={"TUNELAB_LAB_DIR": str(tmp_path / "file")}), 2, "is a file")
    (tmp_path / "dir" / "lab.json").mkdir(parents=True)
    one_line_error(tunelab("lab", "status", env={"TUNELAB_LAB_DIR": str(tmp_path / "dir")}), 1, "cannot be read")


def test_an_error_in_rank_0s_tuner_ends_the_job_with_its_line(tmp_path):
    """Rank 0 alone decides while the others wait for its decision: an error there (one that only rank 0's
    tuner raises, injected through sitecustomize) ends the job with that error's line; it used to wait
    for ever in the runtime's shutdown, which needs every rank."""
    (tmp_path / "sitecustomize.py").write_text(
        "import tunelab.tuning.driver as d\n"
        "real = d.Driver.step_done\n"
        "def step_done(self, elapsed):\n"
        "    if self.phase != 'warmup':\n"
        "        raise RuntimeError('injected failure of the tuner')\n"
        "    return real(self, elapsed)\n"
        "d.Driver.step_done = step_done\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "TUNELAB_HOME": str(tmp_path / "home")}
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "tune", "--model", "replay-bert", "--np", "2",
                             "--budget", "6", "--no-store", "--no-report"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the command stops the ranks it launched (each in its own session)
        try:
            proc.communicate(timeout=30)
        finally:
            proc.kill()
        pytest.fail("the job did not end within 90 s")
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "rank 0: injected failure of the tuner" in err, err[-2000:]


def test_a_store_location_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    proc = tunelab("profiles", "list", env={"TUNELAB_HOME": str(tmp_path / "file")})
    one_line_error(proc, 2, "is TUNELAB_HOME set to a file?")
    # a folder under the file: import makes the missing folders, and met "Not a directory" (exit 1)
    proc = tunelab("profiles", "import", str(DATA / "report-profile-export.json"),
                   env={"TUNELAB_HOME": str(tmp_path / "file" / "sub" / "deeper")})
    one_line_error(proc, 2, f"{tmp_path / 'file'} is a file, not a directory")


def test_a_scenario_lab_with_a_bad_per_host_count_names_that_field(tmp_path):
    bad = tmp_path / "lab.toml"
    bad.write_text('workload = "replay"\nmodel = "bert"\n[lab]\nhosts = 2\nlink_gbps = 1\nranks_per_host = 0\n')
    one_line_error(tunelab("tune", "--scenario", str(bad), "--no-report"), 2, "[lab].ranks_per_host must be")


@pytest.mark.parametrize("latency", [float("inf"), float("nan"), 5e6, -1.0])
def test_a_lab_latency_outside_what_runs_take_is_refused(latency):
    from tunelab.errors import UsageError
    from tunelab.lab.spec import LabSpec

    with pytest.raises(UsageError, match="a link latency must be 0 .. 1e\\+06 us"):
        LabSpec(hosts=2, link_gbps=1.0, link_latency_us=latency)


def test_a_model_whose_values_give_no_time_is_refused_not_printed(model_file, tmp_path):
    """A parameter far out of range (a hand-edited model) made times infinite: it is refused where the
    file is read; and one within what a file may hold (a millisecond a byte) that still predicts days
    for an allreduce is refused where it is predicted, not a table of such times with a crossover made
    up from them."""
    for value, size, fragment in ((1e308, "64MiB", "parameter gamma is 1e+308, more than any fit gives"),
                                  (1e-3, "1GiB", "past the longest time it answers for (1e+06 s)")):
        def huge(d, value=value):
            d["values"].update({k: value for k in d["values"] if k.endswith(".gamma") or k == "gamma"})

        bad = damaged_copy(model_file, huge, tmp_path)
        proc = tunelab("model", "predict", "--model-file", str(bad), "--hosts", "1", "--ranks-per-host", "2",
                       "--no-report", "--sizes", size)
        one_line_error(proc, 2, fragment)


LAB_RUNS = Path(__file__).resolve().parents[1] / "tunelab" / "model" / "runs" / "2026-11-27"


@pytest.fixture(scope="module")
def lab_model_file(tmp_path_factory):
    """A model fitted on the lab's 2-host sweeps and latency runs (once for the module)."""
    out = tmp_path_factory.mktemp("lab-model") / "model.json"
    fit = tunelab("model", "fit", *map(str, sorted(LAB_RUNS.glob("sweep-H2-*-G1*.json"))),
                  *map(str, sorted(LAB_RUNS.glob("lat-H*.json"))), "--out", str(out))
    assert fit.returncode == 0, fit.stderr
    return out


def test_a_model_objective_of_one_rank_is_refused(lab_model_file):
    """``bench tuner --model-file M --hosts 1`` (one rank a host by default) scored a landscape of one rank:
    identical points plus noise."""
    proc = tunelab("bench", "tuner", "--model-file", str(lab_model_file), "--hosts", "1", "--no-report")
    one_line_error(proc, 2, "--hosts 1 with 1 rank a host is one rank")


def test_a_size_past_any_job_is_blamed_on_the_question_not_the_model(lab_model_file):
    """99999GiB at 4 x 2 ranks behind 1 Gb/s takes weeks: the error said the model's values were out of
    range (refit it), though the fitted model was sound."""
    proc = tunelab("model", "predict", "--model-file", str(lab_model_file), "--hosts", "4", "--ranks-per-host",
                   "2", "--link-gbps", "1", "--no-report", "--sizes", "99999GiB")
    one_line_error(proc, 2, "days) for flat at 97.7 TiB, past the longest time it answers for (1e+06 s): ask "
                            "for smaller sizes or fewer ranks")


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d["points"][0]["steps_s"][0].__setitem__(0, 0.0), "a step time must be a positive number"),
    (lambda d: d["points"][0]["steps_s"][0].__setitem__(0, float("nan")), "a step time must be a positive number"),
    (lambda d: d.update(nodes=0), "nodes must be 1 .. world_size"),
    (lambda d: d["points"].__setitem__(0, "x"), "its points must be objects"),
])
def test_a_damaged_landscape_for_a_step_check_is_refused_before_any_table(lab_model_file, tmp_path, change,
                                                                          fragment):
    model = lab_model_file
    bad = damaged_copy(LAB_RUNS / "landscape-lab-H2-K2-G1.json", change, tmp_path, "land.json")
    proc = tunelab("model", "predict", "--model-file", str(model), "--hosts", "2", "--ranks-per-host", "2",
                   "--link-gbps", "1", "--oversubscription", "2", "--scenario", "replay-resnet50-lab",
                   "--check-steps", str(bad), "--no-report")
    one_line_error(proc, 2, fragment)
    assert proc.stdout.strip() == "", proc.stdout  # refused before a table was printed


@pytest.mark.parametrize("target", ["/dev/null", "/dev/stdout"])
def test_json_onto_a_device_still_gives_the_report(tmp_path, target):
    """The report is built from a JSON file read back: onto /dev/null (or stdout) it once ran the whole
    benchmark, then failed with "not JSON" and no report.  It now reads a copy under reports/."""
    pytest.importorskip("matplotlib")
    proc = tunelab("bench", "tuner", "--landscape", "replay-bert-2ranks", "--seeds", "1", "--strategies", "tunelab",
                   "--json", target, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (copy,) = (tmp_path / "reports").glob("tuner-*.json")
    (html,) = (tmp_path / "reports").glob("tuner-*.html")
    assert json.loads(copy.read_text())["rows"] and "replay-bert-2ranks" in html.read_text()
    if target == "/dev/stdout":  # (the JSON went where it was asked, whole)
        start = proc.stdout.index("{\n")
        assert json.loads(proc.stdout[start:proc.stdout.index("\n}\n", start) + 2]) == json.loads(copy.read_text())


# ---- a second audit (2026-11-29): what files hold, past their fields' types ----------------------------
def _deep(folder):
    path = folder / "deep.json"
    path.write_text("[" * 200000 + "]" * 200000)
    return path


@pytest.mark.parametrize("source,fragment", [("deep", "nested too deeply"),
                                             # (read whole, /dev/zero filled memory until the kernel killed it)
                                             ("endless", "longer than 256 MiB")])
@pytest.mark.parametrize("args", [
    ("report", "--bench", "{src}", "--out", "{tmp}/r.html"),
    ("report", "--tune", "{src}", "--out", "{tmp}/r.html"),
    ("model", "fit", "{src}", "--out", "{tmp}/m.json"),
    ("model", "predict", "--model-file", "{src}", "--hosts", "1", "--ranks-per-host", "2", "--no-report"),
    ("bench", "tuner", "--landscape", "{src}", "--seeds", "1", "--no-report"),
    ("profiles", "import", "{src}"),
])
def test_json_nested_too_deeply_or_endless_is_one_line(tmp_path, args, source, fragment):
    src = _deep(tmp_path) if source == "deep" else "/dev/zero"
    argv = [a.format(src=src, tmp=tmp_path) for a in args]
    proc = tunelab(*argv, env={"TUNELAB_HOME": str(tmp_path / "home")}, timeout=60)
    one_line_error(proc, 2, fragment)


@pytest.mark.parametrize("flag", ["--sizes", "--check-sizes"])
def test_a_size_of_hundreds_of_digits_is_a_usage_error(model_file, flag):
    extra = ["--check", str(DATA / "report-allreduce.json")] if flag == "--check-sizes" else []
    proc = tunelab("model", "predict", "--model-file", str(model_file), "--hosts", "1", "--ranks-per-host", "2",
                   "--no-report", *extra, flag, "9" * 400)
    one_line_error(proc, 2, "is too large (at most 4 EiB)")


def _store_with_a_profile(tmp_path):
    home = tmp_path / "home"
    proc = tunelab("profiles", "import", str(DATA / "report-profile-export.json"), env={"TUNELAB_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    return home


@pytest.mark.parametrize("sql", ["UPDATE meta SET value = '99999999999999999999' WHERE key = 'last_profile_id'",
                                 "UPDATE profiles SET id = 9223372036854775807"])
def test_a_store_whose_ids_ran_out_is_one_line_and_kept(tmp_path, sql):
    """A new profile's id past SQLite's integers (an edited or damaged store) was an OverflowError
    traceback; the store is left as it was."""
    import hashlib
    import sqlite3

    home = _store_with_a_profile(tmp_path)
    db = home / "profiles.sqlite"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(sql)
    conn.execute("UPDATE profiles SET hardware_hash = 'another-host'")  # (the import makes a new profile)
    conn.close()  # (the last connection's close writes the log into the file)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    proc = tunelab("profiles", "import", str(DATA / "report-profile-export.json"), env={"TUNELAB_HOME": str(home)})
    one_line_error(proc, 1, "past what SQLite can number")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_an_export_that_import_would_refuse_is_refused_naming_the_profile(tmp_path):
    """A trial dated in the future (a host whose clock was wrong) passes through the store; `profiles
    import` refuses such a file, so the export names the profile rather than write a backup that cannot
    be restored."""
    import sqlite3

    home = _store_with_a_profile(tmp_path)
    with sqlite3.connect(home / "profiles.sqlite") as conn:
        conn.execute("UPDATE trials SET created = '2099-06-01T00:00:00.000+00:00' WHERE rowid = "
                      "(SELECT MIN(rowid) FROM trials)")
    out = tmp_path / "backup.json"
    proc = tunelab("profiles", "export", "--out", str(out), env={"TUNELAB_HOME": str(home)})
    assert proc.returncode != 0 and not out.exists(), (proc.returncode, proc.stdout)
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and "profile 1 cannot be exported" in line[0] and "lies in the future" in line[0], line


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d["profiles"][0]["hardware_facts"].update(memory_bytes=10 ** 400), "holds a number past 2**63"),
    (lambda d: d["profiles"][0]["best"].update(default_score=1e-320), "with a finite ratio"),
    (lambda d: d["profiles"][0].update(world_size="two"), "world_size is missing or not an integer"),
    # (imported, such facts made every later export a RecursionError traceback)
    (lambda d: d["profiles"][0]["hardware_facts"].update(x=functools.reduce(lambda v, _: [v], range(900), [])),
     "nests lists or objects more than 32 levels deep"),
])
def test_an_import_the_store_could_not_read_back_is_refused(tmp_path, change, fragment):
    bad = damaged_copy(DATA / "report-profile-export.json", change, tmp_path)
    home = tmp_path / "home"
    one_line_error(tunelab("profiles", "import", str(bad), env={"TUNELAB_HOME": str(home)}), 2, fragment)
    assert not (home / "profiles.sqlite").exists()


def test_reading_commands_leave_an_empty_sqlite_file_as_it_is(tmp_path):
    import sqlite3

    home = tmp_path / "home"
    home.mkdir()
    db = home / "profiles.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    before = db.read_bytes()
    proc = tunelab("profiles", "list", env={"TUNELAB_HOME": str(home)})
    assert proc.returncode == 0 and "no profiles" in proc.stdout, (proc.stdout, proc.stderr)
    assert db.read_bytes() == before and sorted(p.name for p in home.iterdir()) == ["profiles.sqlite"]


@pytest.mark.parametrize("change,fragment", [
    (lambda d: d.update(world_size=10 ** 12), "world_size must be 1 .. 1048576 ranks"),  # (a hang, building ranks)
    (lambda d: d.update(dtype="S0"), "dtype 'S0' is not one of float32, float16, bfloat16"),
])
def test_a_step_check_landscape_with_impossible_facts_is_refused(tmp_path, change, fragment):
    runs = Path(__file__).resolve().parents[1] / "tunelab" / "model" / "runs" / "2026-11-27"
    model = tmp_path / "lab-model.json"
    proc = tunelab("model", "fit", str(runs / "sweep-H2-K2-G1.json"), "--out", str(model))
    assert proc.returncode == 0, proc.stderr
    bad = damaged_copy(LANDSCAPES / "replay-vgg16-2nodes-10gbps.json", change, tmp_path)
    proc = tunelab("model", "predict", "--model-file", str(model), "--hosts", "2", "--ranks-per-host", "2",
                   "--link-gbps", "10", "--no-report", "--scenario", "replay-vgg16-2nodes", "--check-steps", str(bad),
                   timeout=60)
    one_line_error(proc, 2, fragment)
