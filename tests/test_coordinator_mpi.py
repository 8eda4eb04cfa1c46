"""The background coordinator: stalls, timelines (engine level, no framework)."""

import json

import pytest
from mpi_harness import run_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_stalled_tensor_is_named_on_every_rank(n):
    results = run_ok("coordinator_stall", n, limit_s=90, stall_s=3.0)
    for rank, res in enumerate(results):
        assert "stalled for more than 3 s" in res["message"], (rank, res)
        assert "'lonely' (submitted by ranks [0], missing on ranks " in res["message"]
        assert res["elapsed_s"] < 30


def test_timeline_is_chrome_trace_json_with_allreduces_and_knob_changes(tmp_path):
    path = tmp_path / "timeline.json"
    results = run_ok("coordinator_timeline", 2, path=str(path))
    assert results[0]["changes"] == results[1]["changes"]  # applied at the same cycle everywhere
    assert [c[1] for c in results[0]["changes"]] == [1024, 2048, 3072]
    events = json.loads(path.read_text())
    names = [e["name"] for e in events]
    assert names.count("knobs") == 3 and "allreduce" in names
    spans = [e for e in events if e["name"] == "allreduce"]
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["args"]["tensors"] >= 1 for e in spans)
    assert sum(e["args"]["tensors"] for e in spans) == 12
