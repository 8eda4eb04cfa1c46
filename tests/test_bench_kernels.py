"""``tunelab bench kernels``: the documented JSON on the CPU, one-line errors for GPU back ends it lacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def tunelab(*args: str, timeout: int = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
    """The command, run in ``cwd`` or in a folder of its own (its reports land there), removed after."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tunelab-cli-") as scratch:
        return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], capture_output=True, text=True,
                              timeout=timeout, check=False, cwd=cwd or scratch)


def test_cpu_run_writes_rows_for_every_kernel_with_copy_baseline(tmp_path):
    path = tmp_path / "kernels.json"
    proc = tunelab("bench", "kernels", "--backend", "cpu", "--sizes", "1MiB", "--iters", "2", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert data["backend"] == "cpu" and data["device"]
    assert [r["kernel"] for r in data["rows"]] == ["pack", "unpack", "reduce", "cast"]
    for r in data["rows"]:
        assert set(r) >= {"kernel", "size", "time_us", "gbps", "copy_gbps", "vs_copy"}
        assert r["size"] == 1 << 20 and r["time_us"] > 0
        assert r["gbps"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["vs_copy"] == pytest.approx(r["gbps"] / r["copy_gbps"])
    assert len({r["copy_gbps"] for r in data["rows"]}) == 1  # one copy baseline per size
    assert "vs_copy" in proc.stdout and "pack" in proc.stdout


def _cupy_runs_here() -> bool:
    from tunelab.kernels import get_backend

    try:
        get_backend("cupy")
    except (ImportError, RuntimeError):
        return False
    return True


def test_cupy_without_cupy_or_gpu_is_one_line_and_exit_1():
    if _cupy_runs_here():
        pytest.skip("cupy and a CUDA device are present")
    proc = tunelab("bench", "kernels", "--backend", "cupy", "--sizes", "1MiB", "--iters", "1")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tunelab: error:") and "pip install 'tunelab[gpu]'" in lines[0]


@pytest.mark.parametrize("args,fragment", [
    (["--backend", "tpu"], "invalid choice: 'tpu'"),
    (["--sizes", "12XB"], "invalid size '12XB'"),
    (["--iters", "0"], "expected a positive integer"),
])
def test_bad_flags_exit_2(args, fragment):
    proc = tunelab("bench", "kernels", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_runs_started_together_in_one_folder_keep_their_own_outputs(tmp_path):
    """Reports and their JSON are named by the time to the second: runs started in the same second wrote
    over each other (four runs, two files of each kind); each now has its own."""
    cmd = [sys.executable, "-m", "tunelab.cli", "bench", "kernels", "--backend", "cpu", "--sizes", "4KiB",
           "--iters", "1", "--warmup", "0"]
    runs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    outs = [run.communicate(timeout=120) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in outs]
    written = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert len([w for w in written if w.endswith(".json")]) == 3, written
