"""The code base stays clean under the project's ruff rules (``[tool.ruff]`` in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return [exe] if Path(exe).exists() else None


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (it comes with the dev extra)")
def test_ruff_finds_nothing():
    out = subprocess.run([*_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
