"""The Horovod-style scripts in examples/: each differs from its Horovod form by its import line, and
runs under mpiexec -n 2 (a few steps)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = {  # script: (framework, Horovod's module, short arguments, a line rank 0 prints at the end)
    "pytorch_synthetic_benchmark.py": ("torch", "horovod.torch", ["--num-iters", "2", "--num-batches-per-iter", "2"],
                                       "Total img/sec on 2 rank(s)"),
    "pytorch_mnist.py": ("torch", "horovod.torch", ["--epochs", "1", "--samples", "256"], "Test set: Average loss"),
    "tensorflow2_synthetic_benchmark.py": ("tensorflow", "horovod.tensorflow",
                                           ["--num-iters", "2", "--num-batches-per-iter", "2"],
                                           "Total img/sec on 2 rank(s)"),
    "tensorflow2_keras_mnist.py": ("tensorflow", "horovod.tensorflow.keras", ["--epochs", "2", "--steps-per-epoch", "3"],
                                   "finished gradual learning rate warmup"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_is_its_horovod_form_but_for_the_import(script):
    text = (EXAMPLES / script).read_text()
    mentions = [line for line in text.splitlines() if "tunelab" in line]
    horovod_module = SCRIPTS[script][1]
    assert mentions == [f"import {horovod_module.replace('horovod', 'tunelab', 1)} as hvd"], mentions
    assert not re.search(r"\b_rt\b|tunelab\.", text.replace(mentions[0], "")), "private or tunelab-only names"


@pytest.mark.mpi
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs_on_two_ranks(script, tmp_path):
    framework, _, args, last_line = SCRIPTS[script]
    pytest.importorskip(framework)
    from tunelab.launch import mpiexec_command

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, str(EXAMPLES / script), *args],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_line in proc.stdout, proc.stdout[-2000:]
