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


# The reason a GPU test gives when the machine has a GPU, only too few: --require-gpu leaves it skipped
MORE_GPUS = "needs more CUDA devices than this machine has"


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="a skipped `gpu` test fails instead (on a GPU machine, so it cannot pass by skipping); "
                          "also TUNELAB_REQUIRE_GPU=1")


def _gpu_required(config) -> bool:
    import os

    return bool(config.getoption("--require-gpu")) or os.environ.get("TUNELAB_REQUIRE_GPU", "") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and _gpu_required(item.config):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if MORE_GPUS in reason:  # a GPU machine with fewer GPUs than the test needs: a real skip
            return
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped under --require-gpu: {reason}"
