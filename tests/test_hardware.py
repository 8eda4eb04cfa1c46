"""The hardware fingerprint keys tuning profiles: stable for the same machine and job layout,
different when the layout changes, blind to the hostname and to tiny memory differences."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tunelab import hardware
from tunelab.hardware import Fingerprint, fingerprint, fingerprint_from_facts, parse_nvidia_smi


def test_hash_is_stable_across_calls():
    a, b = fingerprint(1, [2]), fingerprint(1, (2,))
    assert isinstance(a, Fingerprint)
    assert a.hash == b.hash and a.name == b.name
    assert len(a.hash) == 16 and int(a.hash, 16) >= 0
    assert {"cpu_model", "cpu_cores", "memory_gib", "gpu_count", "nodes", "ranks_per_node",
            "mpi_library", "frameworks"} <= set(a.facts)


def test_hash_changes_with_the_job_layout():
    hashes = {fingerprint(1, [2]).hash, fingerprint(1, [4]).hash, fingerprint(2, [2, 2]).hash,
              fingerprint(2, [3, 1]).hash}
    assert len(hashes) == 4


def test_an_emulated_link_is_part_of_the_hardware():
    plain, linked = fingerprint(2, [2, 2]), fingerprint(2, [2, 2], emulated_link="10 Gb/s")
    assert plain.hash != linked.hash != fingerprint(2, [2, 2], emulated_link="25 Gb/s").hash
    assert "emulated_link" not in plain.facts and linked.facts["emulated_link"] == "10 Gb/s"
    assert "2 nodes x 2 ranks (emulated link 10 Gb/s)" in linked.name


def test_hash_ignores_the_hostname(monkeypatch):
    before = fingerprint(1, [2])
    monkeypatch.setattr(hardware.socket, "gethostname", lambda: "some-other-node-17")
    after = fingerprint(1, [2])
    assert after.facts["hostname"] == "some-other-node-17" != before.facts["hostname"]
    assert after.hash == before.hash
    assert "some-other-node-17" not in after.name


def test_a_job_hashes_its_own_framework_at_major_minor_and_not_the_gpu_driver():
    """A torch job's profile is found whether or not TensorFlow is installed beside torch, after a patch
    release or a local build tag, and after a GPU driver update; another torch minor, another CUDA
    version or another framework is other software.  The hash before 2026-11-29 (every recorded fact
    but the hostname, as recorded) stays as ``legacy_hash``, checked here against a digest computed
    independently of the code."""
    import hashlib
    import json

    base = {"hostname": "n1", "cpu_model": "X", "cpu_cores": 8, "memory_gib": 64, "gpu_count": 2,
            "gpu_model": "H100", "gpu_driver": "550.54", "cuda_version": "12.4", "nodes": 1,
            "ranks_per_node": [2], "mpi_library": "MPICH 5.0.2", "frameworks": {"torch": "2.13.0+cpu"}}

    def torch_hash(**changes):
        return fingerprint_from_facts({**base, **changes}, "torch").hash

    same = [torch_hash(), torch_hash(frameworks={"torch": "2.13.1", "tensorflow": "2.21.0"}),
            torch_hash(gpu_driver="560.1", hostname="n2")]
    assert len(set(same)) == 1
    other = {torch_hash(frameworks={"torch": "2.14.0"}), torch_hash(cuda_version="12.6"),
             torch_hash(gpu_count=4), fingerprint_from_facts(base, "tensorflow").hash}
    assert len(other) == 4 and same[0] not in other
    old = {k: v for k, v in base.items() if k != "hostname"}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    assert fingerprint_from_facts(base, "torch").legacy_hash == digest
    assert fingerprint(1, [2], framework="torch").hash == fingerprint(1, [2], frameworks=("torch",),
                                                                      framework="torch").hash


def test_memory_is_rounded_so_tiny_differences_do_not_split_profiles(monkeypatch):
    monkeypatch.setattr(hardware, "_memory_bytes", lambda: (24 << 30) - (3 << 20))
    low = fingerprint(1, [2])
    monkeypatch.setattr(hardware, "_memory_bytes", lambda: (24 << 30) + (5 << 20))
    high = fingerprint(1, [2])
    assert low.hash == high.hash and low.facts["memory_gib"] == 24


def test_a_job_held_to_some_cores_is_other_hardware_and_one_on_all_keeps_its_hash(monkeypatch):
    """taskset or a cgroup's cpuset that leaves 1 of the machine's cores: another profile (its ranks and
    kernel threads share that core); an affinity of every core adds no fact, so the profiles tuned
    before the fact existed still match."""
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    everything = fingerprint(1, [2])
    assert "cpu_usable" not in everything.facts  # (the facts, and so the hash, of before)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    held = fingerprint(1, [2])
    assert held.facts["cpu_usable"] == 1 and held.facts["cpu_cores"] == 8 and held.hash != everything.hash
    assert "(1 of 8 cores," in held.name and "(8 cores," in everything.name
    monkeypatch.delattr(hardware.os, "sched_getaffinity", raising=False)  # (a platform without affinity)
    assert fingerprint(1, [2]).hash == everything.hash


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or shutil.which("taskset") is None, reason="needs CPU affinity, 2 cores and taskset")
def test_the_fingerprint_counts_the_cores_of_the_job_not_those_of_one_bound_rank():
    """Ranks bound to a core each (``-bind-to core``, as Slurm or Open MPI bind) are the same job on the
    same cores as unbound ones: the same profile.  The whole job held to one core (taskset) is not."""
    from mpi_harness import run_ok

    free = run_ok("fingerprint", 2)
    bound = run_ok("fingerprint", 2, launcher=("-bind-to", "core"))
    held = run_ok("fingerprint", 2, prefix=("taskset", "-c", "0"))
    cores = len(os.sched_getaffinity(0))
    assert [r["own"] for r in bound] == [1, 1] and [r["own"] for r in free] == [cores, cores]  # (bound, or not)
    assert {r["host_cores"] for r in bound} == {min(2, cores)}
    if cores == 2:  # the two bound ranks hold every core between them: the unbound job's profile
        assert free[0]["usable"] is None and bound[0]["usable"] is None and free[0]["hash"] == bound[0]["hash"]
    else:  # (two of more cores: the bound job does run on fewer)
        assert bound[0]["usable"] == 2
    assert held[0]["usable"] == 1 and held[0]["hash"] != free[0]["hash"]


def test_name_is_readable():
    fp = fingerprint(1, [2])
    parts = fp.name.split(" | ")
    assert f"({fp.facts['cpu_cores']} cores, {fp.facts['memory_gib']} GiB)" in parts[0]
    assert "1 node x 2 ranks" in parts
    assert fp.facts["hostname"] not in fp.name
    assert "2 nodes x 4+3 ranks" in fingerprint(2, [4, 3]).name
    named = fingerprint_from_facts({**fp.facts, "mpi_library": "MPICH Version: 5.0.2",
                                    "frameworks": {"torch": "2.13.0+cpu"}, "cpu_sockets": 2,
                                    "cpu_model": "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz"})
    assert named.name.startswith("2x Intel Xeon Gold 6148 (")
    assert named.name.endswith(" | MPICH 5.0.2 | torch 2.13")


def test_bad_layout_is_rejected():
    with pytest.raises(ValueError, match="ranks_per_node"):
        fingerprint(2, [2])
    with pytest.raises(ValueError, match="ranks_per_node"):
        fingerprint(1, [0])


def test_parse_nvidia_smi():
    facts = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559 MiB\nNVIDIA H100 80GB HBM3, 81559 MiB\n")
    assert facts == {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "gpu_memory_gib": 80}
    assert parse_nvidia_smi("") == {"gpu_count": 0}
    assert parse_nvidia_smi("No devices were found\n") == {"gpu_count": 0}


_FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo 'NVIDIA H100 80GB HBM3, 81559 MiB, 575.57.08'; echo 'NVIDIA H100 80GB HBM3, 81559 MiB, 575.57.08' ;;
  topo) printf '\\tGPU0\\tGPU1\\tCPU Affinity\\nGPU0\\t X \\tNV18\\t0-63\\nGPU1\\tNV18\\t X \\t0-63\\n' ;;
  *) echo '| NVIDIA-SMI 575.57.08     Driver Version: 575.57.08     CUDA Version: 12.9     |' ;;
esac
"""


@pytest.mark.parametrize("script,count", [
    ("echo 'NVIDIA A100-SXM4-40GB, 40960 MiB'; echo 'NVIDIA A100-SXM4-40GB, 40960 MiB'", 2),
    ("echo 'NVIDIA-SMI has failed' >&2; exit 9", 0),
])
def test_gpus_come_from_nvidia_smi_on_path(tmp_path, monkeypatch, script, count):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    fp = fingerprint(1, [2])
    assert fp.facts["gpu_count"] == count
    if count:
        assert fp.facts["gpu_memory_gib"] == 40 and "2x NVIDIA A100-SXM4-40GB (40 GiB" in fp.name


def test_gpu_fingerprint_names_driver_cuda_and_interconnect(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(_FAKE_SMI)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    fp = fingerprint(1, [2])
    assert {k: fp.facts[k] for k in ("gpu_model", "gpu_count", "gpu_driver", "cuda_version", "gpu_interconnect")} \
        == {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "gpu_driver": "575.57.08",
            "cuda_version": "12.9", "gpu_interconnect": "NV18"}
    assert "2x NVIDIA H100 80GB HBM3 (80 GiB, NV18)" in fp.name
    # another interconnect or CUDA version: another profile; a driver update alone: the same one
    other = fingerprint_from_facts({**fp.facts, "gpu_interconnect": "PHB"})
    assert other.hash != fp.hash
    assert fingerprint_from_facts({**fp.facts, "cuda_version": "12.4"}).hash != fp.hash
    assert fingerprint_from_facts({**fp.facts, "gpu_driver": "550.1"}).hash == fp.hash


def test_a_gpu_query_that_fails_is_said_rather_than_hashed_silently(tmp_path, monkeypatch, capsys):
    """``nvidia-smi topo -m`` failing (or slower than the timeout, on a busy many-GPU node) gave another
    fingerprint without a word, and jobs then missed their tuned profile: the fingerprint says so now."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(_FAKE_SMI.replace("  topo) printf", "  topo) exit 3; printf"))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    fp = fingerprint(1, [2])
    assert fp.facts["cuda_version"] == "12.9" and fp.facts["gpu_interconnect"] != "NV18"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nvidia-smi topo -m failed or gave no answer" in err[0], err
    assert "lacks the interconnect, so a profile tuned on this machine may not be found" in err[0]


@pytest.mark.parametrize("script,said", [
    ("exit 15", "exit status 15"),  # e.g. a GPU fallen off the bus
    ("exit 9", None),               # no driver loaded: a machine without a GPU, nothing to say
    ("exit 6", None),               # no device found: the same
])
def test_a_gpu_listing_that_fails_is_said_where_a_machine_without_gpus_is_not(tmp_path, monkeypatch, capsys,
                                                                             script, said):
    """The listing failing otherwise than for want of a GPU fingerprinted a GPU machine as one without,
    without a word: its tuned profile was then never found."""
    import tunelab.hardware as hw

    monkeypatch.setattr(hw, "_WARNED", set())
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert fingerprint(1, [2]).facts["gpu_count"] == 0
    err = capsys.readouterr().err.strip().splitlines()
    if said is None:
        assert err == []
    else:
        assert len(err) == 1 and f"nvidia-smi --query-gpu failed ({said})" in err[0], err
        assert "counts no GPU" in err[0]


def test_parse_nvidia_topology():
    from tunelab.hardware import parse_nvidia_topology

    text = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV4\tPHB\nGPU1\tNV4\t X \tPHB\nGPU2\tPHB\tPHB\t X \n"
    assert parse_nvidia_topology(text, 3) == "NV4, PHB"
    assert parse_nvidia_topology("", 1) == "single GPU"


def test_fingerprint_does_not_import_frameworks():
    code = textwrap.dedent("""
        import sys
        from tunelab.hardware import fingerprint
        fingerprint(1, [2])
        print(",".join(m for m in ("torch", "tensorflow", "cupy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
