"""The multi-host lab: its spec and usage errors everywhere; as root with iproute2, a real lab whose
hosts have their own hostnames and whose traffic between hosts crosses the shaped links."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from scenario_text import tiny_replay

from tunelab.bench.allreduce import add_link_bound, link_bound_s
from tunelab.errors import UsageError
from tunelab.lab.launch import ranks_per_host
from tunelab.lab.spec import LabHost, LabSpec, LabState


def _root_with_iproute() -> str | None:
    """Why the real-lab tests cannot run here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        return f"needs iproute2 and unshare; missing {', '.join(missing)}"
    if os.path.exists("/run/tunelab-lab/lab.json"):
        return "a lab is up on this machine; these tests would replace it"
    probe = subprocess.run(["ip", "netns", "add", "tlab-test-probe"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:  # root without CAP_SYS_ADMIN (an unprivileged container)
        return f"cannot create network namespaces here: {probe.stderr.strip() or probe.returncode}"
    subprocess.run(["ip", "netns", "delete", "tlab-test-probe"], check=False, capture_output=True)
    return None


_WHY_NO_LAB = _root_with_iproute()
needs_lab = pytest.mark.skipif(_WHY_NO_LAB is not None, reason=str(_WHY_NO_LAB))


def _state(hosts: int = 4, gbps: float = 1.0) -> LabState:
    spec = LabSpec(hosts=hosts, link_gbps=gbps)
    return LabState(spec=spec, hosts=tuple(LabHost(f"tlab-h{i}", spec.host_address(i), f"tlab-v{i}")
                                           for i in range(hosts)), netem=False)


@pytest.mark.parametrize("kwargs, words", [
    ({"hosts": 1, "link_gbps": 1}, "2 to"),
    ({"hosts": 2, "link_gbps": 0}, "a lab link is 0.001 to 1000 Gb/s"),
    ({"hosts": 2, "link_gbps": 1e9}, "a lab link is 0.001 to 1000 Gb/s .*got 1e\\+09"),  # tbf's burst overflowed
    ({"hosts": 2, "link_gbps": 0.0001}, "a lab link is"),  # a rate of 0 mbit
    ({"hosts": 2, "link_gbps": 1, "ranks_per_host": 0}, "--ranks-per-host"),
    ({"hosts": 2, "link_gbps": 1, "subnet": "8.8.8.0/24"}, "private"),
    ({"hosts": 2, "link_gbps": 1, "subnet": "127.5.0.0/24"}, "private"),  # Python calls it private
    ({"hosts": 2, "link_gbps": 1, "subnet": "169.254.9.0/24"}, "private"),
    ({"hosts": 2, "link_gbps": 1, "subnet": "10.0.0.0/30"}, "too small"),
    ({"hosts": 2, "link_gbps": 1, "subnet": "nonsense"}, "bad --subnet"),
])
def test_spec_refuses_bad_shapes(kwargs, words):
    with pytest.raises(UsageError, match=words):
        LabSpec(**kwargs)


@needs_lab
@pytest.mark.parametrize("gbps, shown", [(0.0015, "1500Kbit"), (2.5, "2500Mbit"), (1.0, "1Gbit")])
def test_a_link_is_shaped_at_the_rate_asked_not_rounded_to_whole_mbits(gbps, shown):
    """The kernel's own account of the qdisc (tc qdisc show), on a throwaway veth: 1.5 Mb/s used to
    be shaped at 2 Mb/s, a third faster than the link the lab records and the bound uses."""
    from tunelab.lab import net

    ns = "tlab-test-rate"
    subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        inside = ("ip", "netns", "exec", ns)
        subprocess.run([*inside, "ip", "link", "add", "ra", "type", "veth", "peer", "name", "rb"], check=True)
        net._shape(inside, "ra", gbps, 0)
        shown_now = subprocess.run([*inside, "tc", "qdisc", "show", "dev", "ra"], check=True,
                                   capture_output=True, text=True).stdout
        assert f"rate {shown} " in shown_now, shown_now
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)


def test_state_round_trips_through_json():
    state = _state(3, 10.0)
    again = LabState.from_json(state.to_json())
    assert again == state
    assert [h.address for h in again.hosts] == ["10.213.0.11", "10.213.0.12", "10.213.0.13"]


def test_ranks_spread_evenly_or_usage_error():
    state = _state(4)
    assert ranks_per_host(state, None) == 1
    assert ranks_per_host(state, 8) == 2
    with pytest.raises(UsageError, match="multiple of 4"):
        ranks_per_host(state, 6)


def test_link_bound_is_the_ring_volume_over_the_link():
    # 4 hosts, 64 MiB, 1 Gb/s: each host sends 2*3/4 of 64 MiB = 96 MiB = 805.3 ms at 1e9 bit/s
    assert link_bound_s(64 << 20, 4, 1.0) == pytest.approx(96 * (1 << 20) * 8 / 1e9)
    rows = [{"algorithm": "ring", "size": 1 << 20, "count": 1 << 18, "dtype": "float32", "time_us": 20_000.0}]
    add_link_bound(rows, {"lab": {"hosts": 2, "link_gbps": 1.0}})
    bound = [r for r in rows if r["algorithm"] == "link-bound"]
    assert len(bound) == 1 and bound[0]["time_us"] == pytest.approx((1 << 20) * 8 / 1e9 * 1e6)
    assert rows[0]["time_vs_link"] == pytest.approx(20_000.0 / bound[0]["time_us"])
    # busbw as the measured rows have it, over the run's ranks (4 here, on 2 hosts): a row timed at the
    # bound shows the bound's busbw (with 2 (H-1)/H over hosts it showed less than that row)
    t, size = link_bound_s(64 << 20, 2, 1.0), 64 << 20
    at_bound = {"algorithm": "ring", "size": size, "count": size // 4, "dtype": "float32", "time_us": t * 1e6,
                "algbw_gbps": size / t / 1e9, "busbw_gbps": size / t / 1e9 * 2 * 3 / 4}
    four = [at_bound]
    add_link_bound(four, {"lab": {"hosts": 2, "link_gbps": 1.0}})
    assert four[1]["algorithm"] == "link-bound" and four[1]["busbw_gbps"] == pytest.approx(at_bound["busbw_gbps"])
    plain = [{"algorithm": "ring", "size": 1024, "count": 256, "dtype": "float32", "time_us": 5.0}]
    add_link_bound(plain, {"nodes": 1})
    assert len(plain) == 1 and "time_vs_link" not in plain[0]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=False, capture_output=True,
                          text=True,
                          timeout=300, env=env)


def test_lab_without_root_is_a_usage_error(monkeypatch, capsys):
    from tunelab.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["lab", "up", "--hosts", "2", "--link-gbps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0]


def test_lab_without_iproute_is_a_usage_error(monkeypatch, capsys):
    from tunelab.cli import main

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "tc" else real_which(name, *a, **k))
    assert main(["lab", "status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing: tc" in err[0]


def test_lab_bad_flags_exit_2():
    proc = _cli("lab", "up", "--hosts", "2")
    assert proc.returncode == 2 and "--link-gbps" in proc.stderr


@pytest.fixture
def lab_dir(tmp_path, monkeypatch):
    directory = tmp_path / "lab"
    monkeypatch.setenv("TUNELAB_LAB_DIR", str(directory))
    yield directory
    subprocess.run([sys.executable, "-m", "tunelab.cli", "lab", "down"], check=False, capture_output=True,
                   timeout=120)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith("tlab-"))


@needs_lab
def test_lab_up_status_exec_down(lab_dir):
    subprocess.run(["ip", "netns", "add", "tlab-h7"], check=True)  # what a killed run could leave
    up = _cli("lab", "up", "--hosts", "2", "--link-gbps", "1", "--no-probe")
    assert up.returncode == 0, up.stderr
    assert "removed a lab left behind: tlab-h7" in up.stdout
    assert _namespaces() == ["tlab-h0", "tlab-h1"]
    name = _cli("lab", "exec", "tlab-h1", "--", "hostname")
    assert name.returncode == 0 and name.stdout.strip() == "tlab-h1"
    resolve = _cli("lab", "exec", "tlab-h1", "--", sys.executable, "-c",
                   "import socket; print(socket.gethostbyname('tlab-h0'))")
    assert resolve.stdout.strip() == "10.213.0.11"
    # a peer's address named back, as a dual-stack socket reports it (torch's c10d does this for every
    # connection): answered by the lab's hosts file, not sent to a DNS the namespace cannot reach
    for addr in ("10.213.0.11", "::ffff:10.213.0.11"):
        back = _cli("lab", "exec", "tlab-h1", "--", sys.executable, "-c",
                    f"import socket; print(socket.getnameinfo(({addr!r}, 0), socket.NI_NAMEREQD)[0])")
        assert back.returncode == 0 and back.stdout.strip() == "tlab-h0", (addr, back.stdout, back.stderr)
    status = _cli("lab", "status")
    assert status.returncode == 0 and "tbf" in status.stdout and "rate 1Gbit" in status.stdout
    bad = _cli("lab", "exec", "tlab-h9", "--", "true")
    assert bad.returncode == 2 and "unknown lab host" in bad.stderr
    down = _cli("lab", "down")
    assert down.returncode == 0 and _namespaces() == []
    assert not (lab_dir / "lab.json").exists()
    after = _cli("lab", "status")
    assert after.returncode == 0 and "no lab is up" in after.stdout


@needs_lab
def test_the_lab_touches_only_its_own_and_a_refused_or_broken_lab_says_so(lab_dir):
    """Namespaces, links and files that only look like the lab's are never removed; a refused `lab up`
    leaves the lab that was up; a lab missing its bridge or shaping is broken, exit 2 for a run."""
    from tunelab.lab.spec import clear_lab_dir

    subprocess.run(["ip", "netns", "add", "tlab-mine"], check=True)
    subprocess.run(["ip", "link", "add", "tlab-vx", "type", "veth", "peer", "name", "tlab-other"], check=True)
    lab_dir.mkdir()
    (lab_dir / "hosts-inventory.txt").write_text("mine\n")
    try:
        assert _cli("lab", "up", "--hosts", "2", "--link-gbps", "1", "--no-probe").returncode == 0
        # refused inside `lab up`, after the spec passed: a subnet this host routes (a route made here)
        subprocess.run(["ip", "route", "add", "blackhole", "10.99.0.0/24"], check=True)
        refused = _cli("lab", "up", "--hosts", "3", "--link-gbps", "1", "--subnet", "10.99.0.0/24", "--no-probe")
        assert refused.returncode == 2 and "overlaps the host's route" in refused.stderr, refused.stderr
        assert _namespaces() == ["tlab-h0", "tlab-h1", "tlab-mine"]  # the lab that was up is still up
        assert _cli("lab", "status").returncode == 0
        subprocess.run(["tc", "qdisc", "del", "dev", "tlab-v1", "root"], check=True)
        broken = _cli("lab", "status")
        assert broken.returncode == 1 and "the shaping of tlab-v1" in broken.stderr, broken.stderr
        subprocess.run(["ip", "link", "delete", "tlab-br"], check=True)
        run = _cli("bench", "allreduce", "--lab", "--np", "2", "--sizes", "1KiB", "--iters", "1", "--no-report")
        assert run.returncode == 2 and "the lab is broken (missing the bridge tlab-br" in run.stderr, run.stderr
        assert _cli("lab", "down").returncode == 0
        assert _namespaces() == ["tlab-mine"]
        links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
        assert "tlab-vx" in links and "tlab-other" in links
        clear_lab_dir(lab_dir)
        assert (lab_dir / "hosts-inventory.txt").read_text() == "mine\n"
    finally:
        subprocess.run(["ip", "route", "delete", "blackhole", "10.99.0.0/24"], check=False)
        subprocess.run(["ip", "netns", "delete", "tlab-mine"], check=False)
        subprocess.run(["ip", "link", "delete", "tlab-vx"], check=False)


@needs_lab
@pytest.mark.mpi
def test_every_system_crosses_the_shaped_link(lab_dir):
    from tunelab.lab import down, up
    from tunelab.lab.net import link_counters
    from tunelab.launch import run_job

    state = up(LabSpec(hosts=2, link_gbps=2.0), probe=True)
    try:
        assert state.sustained_gbps is not None and 0.5 < state.sustained_gbps < 2.2  # tbf holds the rate
        before = link_counters(state)
        size, iters, warmup = 4 << 20, 2, 1
        algos = ["ring", "mpi", "gloo"]
        params = {"iters": iters, "warmup": warmup, "ranks_per_node": None, "knobs": {}, "sizes": [size],
                  "dtype": "float32", "algorithms": algos, "link_gbps": None, "link_latency_us": 0.0,
                  "device": "cpu"}
        result = run_job("bench-allreduce", params, 2, timeout_s=240, lab=state)
        after = link_counters(state)
    finally:
        down()
    hw = result["hardware"]
    assert hw["hostname"] == "tlab-h0" and hw["lab"]["hosts"] == 2 and hw["nodes"] == 2
    rows = {r["algorithm"]: r for r in result["rows"]}
    assert all(rows[a]["wrong"] == 0 for a in algos)
    # Each host sends at least half the data per allreduce (2 hosts): if one system bypassed the
    # link (shared memory between namespaces), host 0 would have sent a third less than this.
    sent = after["tlab-h0"]["sent_bytes"] - before["tlab-h0"]["sent_bytes"]
    assert sent >= len(algos) * (iters + warmup) * size // 2


_HOLDER = """
import sys
from tunelab.lab import session
from tunelab.lab.spec import LabSpec
with session(False, LabSpec(hosts=2, link_gbps=5.0)) as lab:
    print("on", lab.users, flush=True)
    sys.stdin.readline()  # on the lab until told (or killed)
"""


def _holder() -> subprocess.Popen:
    """A scenario run on the lab (another process), holding it until its stdin gets a line."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().startswith("on"), proc.returncode
    return proc


@needs_lab
def test_a_scenarios_lab_is_taken_down_by_the_last_run_on_it_and_after_a_killed_one(lab_dir):
    """Two scenario runs on one lab: the first to end took the lab down under the other's ranks (and
    killed them); a run killed on its lab left the lab up for good, since the next run only reused it."""
    from tunelab.lab import load_state, session

    spec = LabSpec(hosts=2, link_gbps=5.0)
    with session(False, spec) as lab:  # brought up by this run
        assert lab.scenario and lab.users == (os.getpid(),)
        other = _holder()  # reuses it
        assert load_state().users == (os.getpid(), other.pid)
    assert _namespaces() == ["tlab-h0", "tlab-h1"] and load_state().users == (other.pid,)  # the other is on it
    other.communicate("\n", timeout=60)
    assert _namespaces() == [] and not (lab_dir / "lab.json").exists()  # the last run took it down
    killed = _holder()  # brings it up, then dies on it
    killed.kill()
    killed.wait(timeout=30)
    assert _namespaces() == ["tlab-h0", "tlab-h1"]
    with session(False, spec) as lab:
        assert lab.users == (os.getpid(),)  # (the dead run dropped out)
    assert _namespaces() == [] and not (lab_dir / "lab.json").exists()


LAB_SCENARIO = tiny_replay("tiny-lab", budget=3, forward_ms=10, backward_ms=20, np=None,
                           lab="hosts = 2\nlink_gbps = 5\nranks_per_host = 1")


@needs_lab
@pytest.mark.mpi
def test_tune_brings_a_scenarios_lab_up_and_down(lab_dir, tmp_path):
    scenario = tmp_path / "tiny-lab.toml"
    scenario.write_text(LAB_SCENARIO)
    out = tmp_path / "tune.json"
    proc = _cli("tune", "--scenario", str(scenario), "--no-store", "--no-report", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# on the lab: 2 hosts x 1 rank, 5 Gb/s links" in proc.stdout and "on 2 ranks" in proc.stdout
    assert _namespaces() == [] and not (lab_dir / "lab.json").exists()  # taken down after the run
    import json

    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["nodes"] == 2  # each rank on a host of its own

    other = _cli("lab", "up", "--hosts", "3", "--link-gbps", "1", "--no-probe")
    assert other.returncode == 0, other.stderr
    clash = _cli("tune", "--scenario", str(scenario), "--no-store", "--no-report")
    assert clash.returncode == 2 and "a different lab is up" in clash.stderr
    assert _namespaces() == ["tlab-h0", "tlab-h1", "tlab-h2"]  # the user's lab is left alone


def test_bench_train_records_the_lab_it_ran_on_as_bench_allreduce_does(tmp_path, monkeypatch):
    """A training benchmark run on a lab's hosts says so in its hardware facts (hosts, ranks a host,
    the link), as the allreduce benchmark's do; outside a lab it records none."""
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from tunelab.bench.train import _hardware
    from tunelab.config import ENV_LAB_STATE

    monkeypatch.delenv(ENV_LAB_STATE, raising=False)
    assert "lab" not in _hardware(MPI.COMM_SELF)
    (tmp_path / "lab.json").write_text(_state(2, 2.5).to_json())
    monkeypatch.setenv(ENV_LAB_STATE, str(tmp_path / "lab.json"))
    lab = _hardware(MPI.COMM_SELF)["lab"]
    assert (lab["hosts"], lab["ranks_per_host"], lab["link_gbps"]) == (1, 1, 2.5)  # (this one rank is one host)
