"""tests/gpu_check.sh, the one command a GPU session runs: it refuses an unknown step (exit 2), and a
step that fails (here, without a GPU, every one does) is reported in the summary without stopping the
steps after it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu_check.sh"


def _run(tmp_path: Path, *steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "HOME": str(tmp_path)}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *steps], check=False, capture_output=True,
                          text=True, timeout=120, cwd=SCRIPT.parent.parent, env=env)


def test_an_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    run = _run(tmp_path, "kernels", "bogus")
    assert run.returncode == 2 and "unknown step 'bogus'" in run.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the step would run in full")
def test_a_failing_step_is_summarised_and_the_next_one_runs(tmp_path: Path) -> None:
    stale = tmp_path / "out" / "kernels-cupy.json"
    stale.parent.mkdir()
    stale.write_text("{}")  # an earlier run's: not to be read as this one's
    run = _run(tmp_path, "kernels")
    assert run.returncode == 1 and not stale.exists(), run.stdout  # a failed step fails the script
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["kernels-cupy", "kernels-numba"], run.stdout
    assert all(line.split()[1] not in ("rc=0", "rc=124") for line in summary), summary  # failed, not timed out
    assert "needs" in (tmp_path / "out" / "kernels-numba.log").read_text()
