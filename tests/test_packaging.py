"""The package list in pyproject.toml names every package under tunelab/ (a package left out is
missing from a non-editable install, while an editable one hides the mistake)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tunelab").rglob("__init__.py")}
    assert found - listed == set()
