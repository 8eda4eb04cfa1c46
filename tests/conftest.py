import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _private_profile_store(tmp_path, monkeypatch):
    """Tests (and the commands they start) use a profile store of their own, never the user's."""
    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path / "tunelab-home"))


@pytest.fixture(scope="session", autouse=True)
def _warm_kernel_cache():
    """Compile the CPU kernels once in this process so launched ranks load them from Numba's cache
    instead of all compiling at once."""
    from kernels_warmup import warm

    warm()


def pytest_collection_modifyitems(config, items):
    if shutil.which("mpiexec") is None and not (Path(sys.executable).parent / "mpiexec").exists():
        skip = pytest.mark.skip(reason="no mpiexec: install the mpich wheel")
        for item in items:
            if "mpi" in item.keywords:
                item.add_marker(skip)
