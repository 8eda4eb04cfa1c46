"""The profile store keeps every finished trial through concurrent writers and killed jobs, refuses
files it does not understand without touching them, and moves profiles between hosts losslessly."""

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tunelab.config import tunelab_home
from tunelab.errors import StoreError
from tunelab.profile_export import InvalidExport
from tunelab.profiles import FILE_NAME, ProfileKey, ProfileStore

KEY = ProfileKey("aaaa000011112222", "resnet50:25.6M:161", "torch", 2)
FACTS = {"hostname": "n1", "cpu_model": "AMD EPYC", "cpu_cores": 2, "memory_gib": 24, "gpu_count": 0,
         "nodes": 1, "ranks_per_node": [2], "mpi_library": "MPICH Version: 5.0.2",
         "frameworks": {"torch": "2.13.0"}}
KNOBS = {"fusion_threshold_bytes": 64 << 20, "cycle_time_ms": 1.0, "hierarchical": False,
         "group_fusion": True, "segment_bytes": 4 << 20}


def new_profile(store, key=KEY, facts=FACTS, name="hw"):
    return store.upsert_profile(key, name, facts, "resnet50")


def trial(store, pid, score, phase="explore", run="r1", **knobs):
    return store.record_trial(pid, {**KNOBS, **knobs}, score, 0.05, 20, 3.5, run, phase)


@pytest.fixture
def store(tmp_path):
    return ProfileStore(tmp_path / "missing" / "dir" / FILE_NAME)


@pytest.fixture
def home_store():
    """The store at TUNELAB_HOME (the test's own, from conftest), where ``tune`` writes."""
    return ProfileStore()


# -- round trips ---------------------------------------------------------------------------------

def test_missing_directory_is_created_and_upsert_is_idempotent(store):
    assert store.path.exists()
    pid = new_profile(store)
    assert new_profile(store, name="hw renamed") == pid
    assert [p.id for p in store.profiles()] == [pid]
    assert store.get(pid).hardware_name == "hw renamed" and store.get(pid).key == KEY
    assert store.get(pid + 1) is None


def test_trials_round_trip_in_order_with_numpy_values(store):
    pid = new_profile(store)
    ids = [store.record_trial(pid, {**KNOBS, "segment_bytes": np.int64(1 << 20), "hierarchical": np.bool_(True),
                                    "cycle_time_ms": np.float32(2.5)},
                              np.float64(100.0 + i), np.float32(0.25), np.int64(20), 3.0, "run-a", phase)
           for i, phase in enumerate(["default", "explore", "remeasure", "locked"])]
    trials = store.trials(pid)
    assert [t.id for t in trials] == ids == sorted(ids)
    assert [t.phase for t in trials] == ["default", "explore", "remeasure", "locked"]
    assert [t.score for t in trials] == [100.0, 101.0, 102.0, 103.0]
    first = trials[0]
    assert first.knobs["segment_bytes"] == 1 << 20 and type(first.knobs["segment_bytes"]) is int
    assert first.knobs["hierarchical"] is True and first.knobs["cycle_time_ms"] == 2.5
    assert first.spread == 0.25 and first.steps == 20 and first.run_id == "run-a"
    assert len({t.uid for t in trials}) == 4
    assert store.profiles()[0].n_trials == 4


def test_bad_trials_are_rejected(store):
    pid = new_profile(store)
    with pytest.raises(ValueError, match="phase"):
        trial(store, pid, 1.0, phase="warmup")
    with pytest.raises(ValueError, match="score"):
        trial(store, pid, float("nan"))
    with pytest.raises(StoreError, match="no profile with id 999"):
        trial(store, 999, 1.0)
    assert store.trials(pid) == []


def test_best_and_gain(store):
    pid = new_profile(store)
    assert store.best(KEY) is None
    store.set_best(pid, {**KNOBS, "segment_bytes": 1 << 20}, 120.0, 100.0, 0.02, "r1")
    store.set_best(pid, {**KNOBS, "segment_bytes": 2 << 20}, 125.0, 100.0, 0.03, "r2")
    best = store.best(KEY)
    assert best.profile_id == pid and best.knobs["segment_bytes"] == 2 << 20 and best.run_id == "r2"
    assert best.gain == pytest.approx(1.25) and store.get(pid).best_gain == pytest.approx(1.25)
    assert store.best(ProfileKey(KEY.hardware_hash, KEY.model_signature, KEY.framework, 4)) is None
    with pytest.raises(ValueError, match="default_score"):
        store.set_best(pid, KNOBS, 1.0, 0.0, 0.0, "r3")


def test_best_keeps_the_gain_interval_steps_and_outcome(store, tmp_path):
    pid = new_profile(store)
    store.set_best(pid, KNOBS, 112.0, 100.0, 0.02, "r1", gain_interval=(1.12, 1.07, 1.18), steps=64, outcome="converged")
    best = store.best(KEY)
    assert (best.gain_low, best.gain_high, best.steps, best.outcome) == (1.07, 1.18, 64, "converged")
    assert best.interval_text() == "1.120x [1.070, 1.180]"
    store.set_best(pid, KNOBS, 100.0, 100.0, 0.02, "r2", steps=80, outcome="budget exhausted")  # default kept
    best = store.best(KEY)
    assert best.gain_low is None and best.steps == 80 and best.interval_text() == "1.000x"
    data = json.loads(json.dumps(store.export()))
    assert data["profiles"][0]["best"]["outcome"] == "budget exhausted"
    data["profiles"][0]["best"]["steps"] = "many"
    with pytest.raises(InvalidExport, match="steps"):
        ProfileStore(tmp_path / "other" / FILE_NAME).merge(data)


def test_a_schema_1_store_is_upgraded_in_place_keeping_its_best(tmp_path):
    path = tmp_path / FILE_NAME
    a, _ = populated(ProfileStore(path))
    conn = sqlite3.connect(path)
    with conn:  # back to what tunelab wrote before schema 2
        conn.execute("CREATE TABLE best1 (profile_id INTEGER PRIMARY KEY REFERENCES profiles(id) ON DELETE"
                     " CASCADE, knobs TEXT NOT NULL, score REAL NOT NULL, default_score REAL NOT NULL,"
                     " spread REAL NOT NULL, run_id TEXT NOT NULL, updated TEXT NOT NULL)")
        conn.execute("INSERT INTO best1 SELECT profile_id, knobs, score, default_score, spread, run_id, updated"
                     " FROM best")
        conn.execute("DROP TABLE best")
        conn.execute("ALTER TABLE best1 RENAME TO best")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.close()
    before = path.read_bytes()  # read as it is first, as a training job and the reading commands do
    reader = ProfileStore(path, create=False)
    assert reader.best(KEY).score == 102.0 and reader.best(KEY).gain_low is None
    listed = cli(tmp_path, "list")
    assert listed.returncode == 0 and "1.020x" in listed.stdout, (listed.stdout, listed.stderr)
    assert path.read_bytes() == before
    store = ProfileStore(path)
    best = store.best_of(a)
    assert best.score == 102.0 and best.gain_low is None and best.steps is None
    store.set_best(a, KNOBS, 110.0, 100.0, 0.01, "r9", gain_interval=(1.1, 1.02, 1.2), steps=9, outcome="converged")
    assert ProfileStore(path).best_of(a).gain_high == 1.2
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "3"
    conn.close()


def test_the_stored_gain_is_the_tuners_estimate_not_the_ratio_of_the_two_means(store, tmp_path):
    """Under drift the locked configuration's mean over the default's mean can lie outside the paired
    interval (an H100 run: 903.86 / 891.61 = 1.014 against 1.187x [1.088, 1.295]); the store keeps the
    tuner's estimate, and every reader shows it with its interval."""
    pid = new_profile(store)
    store.set_best(pid, KNOBS, 903.86, 891.61, 0.02, "r1", gain_interval=(1.187, 1.088, 1.295), steps=163,
                   outcome="budget exhausted")
    best = store.best(KEY)
    assert best.gain == 1.187 and best.estimate == 1.187 and best.interval_text() == "1.187x [1.088, 1.295]"
    assert best.score == 903.86 and best.default_score == 891.61  # the means stay as measured
    assert store.get(pid).best_gain == pytest.approx(1.187)
    data = json.loads(json.dumps(store.export()))
    assert data["profiles"][0]["best"]["gain"] == 1.187
    other = ProfileStore(tmp_path / "other" / FILE_NAME)
    other.merge(data)
    assert other.best(KEY).gain == 1.187 and other.best(KEY).interval_text() == "1.187x [1.088, 1.295]"
    with pytest.raises(ValueError, match="outside its interval"):
        store.set_best(pid, KNOBS, 903.86, 891.61, 0.02, "r2", gain_interval=(1.014, 1.088, 1.295))
    data["profiles"][0]["best"]["gain"] = 1.014
    with pytest.raises(InvalidExport, match="gain must lie within"):
        ProfileStore(tmp_path / "third" / FILE_NAME).merge(data)


def test_a_schema_2_store_is_upgraded_and_its_locks_show_their_interval_alone(tmp_path):
    path = tmp_path / FILE_NAME
    store = ProfileStore(path)
    pid = new_profile(store)
    store.set_best(pid, KNOBS, 903.86, 891.61, 0.02, "r1", gain_interval=(1.187, 1.088, 1.295))
    conn = sqlite3.connect(path)
    with conn:  # back to what tunelab wrote before schema 3: no estimate
        conn.execute("ALTER TABLE best DROP COLUMN gain")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.close()
    before = path.read_bytes()
    reader = ProfileStore(path, create=False)  # a job looking up its profile: no write access needed
    best = reader.best(KEY)
    assert best.estimate is None and best.gain == pytest.approx(903.86 / 891.61)
    assert best.interval_text() == "[1.088, 1.295]x"  # not 1.014x beside an interval that excludes it
    assert reader.get(pid).best_gain == pytest.approx(903.86 / 891.61) and reader.export()["profiles"]
    listed = cli(tmp_path, "list")  # (the list's gain as show gives it: the interval, not 1.014 outside it)
    assert listed.returncode == 0 and "[1.088, 1.295]x" in listed.stdout and "1.014" not in listed.stdout, listed
    assert path.read_bytes() == before  # read as it is
    reader.set_best(pid, KNOBS, 910.0, 891.61, 0.02, "r2", gain_interval=(1.19, 1.09, 1.3))  # a write upgrades
    assert ProfileStore(path, create=False).best(KEY).interval_text() == "1.190x [1.090, 1.300]"
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "3"
    assert "gain" in {r[1] for r in conn.execute("PRAGMA table_info(best)")}
    conn.close()


def test_nearest_prefers_same_world_size_then_most_equal_facts(store):
    def make(hw, world, facts, model="resnet50:25.6M:161", framework="torch"):
        return new_profile(store, ProfileKey(hw, model, framework, world), facts)

    similar = make("hw-similar", 2, {**FACTS, "hostname": "x", "cpu_cores": 4})
    make("hw-different", 2, {**FACTS, "cpu_model": "Intel", "cpu_cores": 64, "memory_gib": 512})
    same_hw_other_world = make("hw-target", 4, FACTS)
    make("hw-target", 2, FACTS, model="bert:110M:200")
    make("hw-target", 2, FACTS, framework="tensorflow")
    target = ProfileKey("hw-target", "resnet50:25.6M:161", "torch", 2)
    assert store.nearest(target).id == similar  # facts looked up from the hw-target profiles
    assert store.nearest(target, hardware_facts={}).world_size == 2
    only_other_world = ProfileKey("hw-target", "resnet50:25.6M:161", "torch", 8)
    assert store.nearest(only_other_world).id == same_hw_other_world
    assert store.nearest(ProfileKey("hw-target", "gpt2:124M:148", "torch", 2)) is None
    own = store.nearest(ProfileKey("hw-similar", "resnet50:25.6M:161", "torch", 2))
    assert own.id != similar  # never itself


def test_a_new_profile_is_seeded_from_the_hardware_most_like_this_one(home_store):
    store = home_store
    """``tune`` on hardware the store has never seen: its own facts, not the (absent) stored ones of its
    hash, pick the profile to warm-start from; without them the most trials won."""
    from types import SimpleNamespace

    from tunelab.tuning.run import Workload, _Recorder

    model = "resnet50:25.6M:161"
    similar = new_profile(store, ProfileKey("hw-similar", model, "torch", 2), {**FACTS, "hostname": "n2"})
    other = new_profile(store, ProfileKey("hw-other", model, "torch", 2), {**FACTS, "cpu_model": "Xeon", "gpu_count": 8})
    for score in (1.0, 2.0, 3.0):
        trial(store, other, score)
    rt = SimpleNamespace(fingerprint=lambda framework=None: SimpleNamespace(name="new host", facts=dict(FACTS)),
                         profile_keys=lambda sig, fw, legacy=None: [ProfileKey("hw-new", sig, fw, 2)])
    work = Workload(lambda: None, 1.0, model, "resnet50")
    recorder = _Recorder.create({"framework": "torch", "workload": "torch"}, rt, work, write=False)
    assert recorder.seeded_from is not None and recorder.seeded_from.id == similar
    # a first run killed before it measured a block left its profile without trials: the next run is
    # seeded as a new profile's is (it was not: a profile of its own, empty, was all it read)
    killed = _Recorder.create({"framework": "torch", "workload": "torch"}, rt, work)
    assert killed.profile_id is not None and store.trials(killed.profile_id) == []
    again = _Recorder.create({"framework": "torch", "workload": "torch"}, rt, work)
    assert again.profile_id == killed.profile_id
    assert again.seeded_from is not None and again.seeded_from.id == similar


def test_tune_goes_on_in_a_profile_stored_under_the_models_earlier_key(home_store):
    store = home_store
    """A profile tuned before the torch key stopped depending on the parameters' order is where a
    second ``tune`` records (and where jobs find it: they look the earlier key up too)."""
    from types import SimpleNamespace

    from tunelab.runtime import Runtime
    from tunelab.tuning.run import Workload, _Recorder

    rt = SimpleNamespace(fingerprint=lambda framework=None: SimpleNamespace(
        name="host", facts=dict(FACTS), hash=KEY.hardware_hash, legacy_hash=KEY.hardware_hash),
        topology=SimpleNamespace(size=2))
    rt.profile_keys = lambda *args: Runtime.profile_keys(rt, *args)
    earlier = new_profile(store, ProfileKey(KEY.hardware_hash, "6p-ordered", "torch", 2))
    trial(store, earlier, 10.0)
    work = Workload(lambda: None, 1.0, "6p-sorted", "resnet50", legacy_signature="6p-ordered")
    # --no-store reads it where it is; a stored run moves it to the new key, trials and all
    assert _Recorder.create({"framework": "torch", "workload": "torch"}, rt, work, write=False).profile_id == earlier
    assert store.get(earlier).model_signature == "6p-ordered"
    assert _Recorder.create({"framework": "torch", "workload": "torch"}, rt, work).profile_id == earlier
    assert store.get(earlier).model_signature == "6p-sorted" and len(store.trials(earlier)) == 1
    fresh = Workload(lambda: None, 1.0, "7p-sorted", "resnet50", legacy_signature="7p-ordered")
    made = _Recorder.create({"framework": "torch", "workload": "torch"}, rt, fresh).profile_id
    assert made != earlier and store.get(made).model_signature == "7p-sorted"  # nothing earlier: the new key
    # a profile of the same model on other hardware, stored under the earlier key, still seeds a new one
    other = new_profile(store, ProfileKey("hw-other", "8p-ordered", "torch", 2))
    seeded = _Recorder.create({"framework": "torch", "workload": "torch"}, rt,
                              Workload(lambda: None, 1.0, "8p-sorted", "resnet50", legacy_signature="8p-ordered"))
    assert seeded.seeded_from is not None and seeded.seeded_from.id == other


def test_a_knob_this_version_does_not_know_says_upgrade_not_delete(tmp_path):
    """A newer tunelab adds knobs without a new schema: its profiles, read here, are not damaged."""
    home = tmp_path / "home"
    a, _ = populated(ProfileStore(home / FILE_NAME))
    conn = sqlite3.connect(home / FILE_NAME)
    conn.execute("UPDATE best SET knobs = json_set(knobs, '$.allgather_max_bytes', 65536) WHERE profile_id = ?", (a,))
    conn.commit()
    conn.close()
    shown = cli(home, "show", str(a))
    one_error_line(shown, 1, "has a knob this version of tunelab does not know")
    assert "'allgather_max_bytes'" in shown.stderr and "upgrade tunelab" in shown.stderr
    assert "is damaged" not in shown.stderr
    from tunelab.profiles import DamagedProfileError

    with pytest.raises(DamagedProfileError, match="a newer tunelab wrote it"):  # (delete still takes it)
        ProfileStore(home / FILE_NAME, create=False).best_of(a)


def test_delete_removes_trials_and_best(store):
    pid, other = new_profile(store), new_profile(store, ProfileKey("b" * 16, "m", "torch", 2))
    trial(store, pid, 10.0)
    trial(store, other, 11.0)
    store.set_best(pid, KNOBS, 10.0, 9.0, 0.0, "r1")
    assert store.delete(pid) is True and store.delete(pid) is False
    assert store.get(pid) is None and store.trials(pid) == [] and store.best(KEY) is None
    assert len(store.trials(other)) == 1


def test_a_deleted_profiles_id_is_never_given_again(store):
    """A run holds its profile's id while it tunes: deleted meanwhile, and a new profile made, its writes
    must fail (the profile is gone), not land in the new one, as they would if SQLite gave the id again."""
    a = new_profile(store)
    b = new_profile(store, ProfileKey("b" * 16, "m", "torch", 2))
    assert store.delete(b)
    c = new_profile(store, ProfileKey("c" * 16, "other", "torch", 8))
    assert c not in (a, b) and c > b
    with pytest.raises(StoreError, match=f"no profile with id {b}"):
        trial(store, b, 10.0)
    with pytest.raises(StoreError, match=f"no profile with id {b}"):
        store.set_best(b, KNOBS, 10.0, 9.0, 0.0, "r1")
    assert store.trials(c) == [] and store.best_of(c) is None
    # the same for a profile an import adds, and the largest id (deleted last) is not given again either
    assert store.delete(c)
    data = ProfileStore(Path(str(store.path) + ".src"))
    data.upsert_profile(ProfileKey("d" * 16, "m", "torch", 2), "hw", FACTS, "m")
    (d,) = store.merge(data.export()).profile_ids
    assert d > c
    assert new_profile(store, ProfileKey("e" * 16, "m", "torch", 2)) > d


# -- export / import -----------------------------------------------------------------------------

def populated(store):
    a = new_profile(store)
    b = new_profile(store, ProfileKey("c" * 16, "bert:110M:200", "tensorflow", 4), {**FACTS, "nodes": 2})
    for i in range(3):
        trial(store, a, 100.0 + i, segment_bytes=(1 << 20) * (i + 1))
    trial(store, b, 50.0, phase="default")
    store.set_best(a, {**KNOBS, "segment_bytes": 3 << 20}, 102.0, 100.0, 0.01, "r1",
                   gain_interval=(1.02, 1.011, 1.030), steps=57, outcome="converged")
    return a, b


def test_export_import_round_trip_and_reimport_adds_nothing(store, tmp_path):
    a, b = populated(store)
    data = json.loads(json.dumps(store.export()))
    assert data["format"] == "tunelab-profiles" and data["version"] == 1 and len(data["profiles"]) == 2
    fresh = ProfileStore(tmp_path / "fresh.sqlite")
    result = fresh.merge(data)
    assert (result.profiles_added, result.trials_added, len(result.profile_ids)) == (2, 4, 2)
    assert fresh.export() == data
    assert fresh.import_(data) == result.profile_ids and fresh.export() == data
    again = fresh.merge(data)
    assert (again.profiles_added, again.trials_added) == (0, 0)
    assert store.merge(data).trials_added == 0 and len(store.trials(a)) == 3
    assert len(store.export([b])["profiles"]) == 1
    with pytest.raises(StoreError, match="no profile with id 99"):
        store.export([99])


def test_an_import_stores_knob_values_as_a_job_reads_them(store, tmp_path):
    """Values written by hand in an export ("4MiB", "yes", "10") are stored as the numbers and
    booleans a job applies, as the store's own runs write them: jobs compare stored knobs with their
    own, and a kept default written "10" once read as tuned."""
    a, _ = populated(store)
    data = store.export([a])
    data["profiles"][0]["trials"][0]["knobs"].update(segment_bytes="4MiB", hierarchical="no", cycle_time_ms="10")
    data["profiles"][0]["best"]["knobs"].update(hierarchical="yes", fusion_threshold_bytes="1MiB")
    fresh = ProfileStore(tmp_path / "fresh.sqlite")
    fresh.merge(data)
    (p,) = fresh.export()["profiles"]
    uid = data["profiles"][0]["trials"][0]["uid"]
    (first,) = [t for t in p["trials"] if t["uid"] == uid]
    assert (first["knobs"]["segment_bytes"], first["knobs"]["hierarchical"], first["knobs"]["cycle_time_ms"]) \
        == (4 << 20, False, 10.0)
    assert (p["best"]["knobs"]["hierarchical"], p["best"]["knobs"]["fusion_threshold_bytes"]) == (True, 1 << 20)


def test_an_imports_times_are_checked_and_stored_as_the_store_writes_its_own(store, tmp_path):
    """The store keeps the later of two ``updated`` as text: a hand-edited "yesterday" or a year 9999
    would sort after every real time for good, so they are refused, naming the field; a time without a
    zone, or in another one, is stored in UTC as the store's own."""
    from tunelab.profile_export import InvalidExport

    a, _ = populated(store)
    for where, value, words in ((("updated",), "yesterday", "profiles[0].updated is not an ISO 8601 time"),
                                (("trials", 0, "created"), "9999-01-01T00:00:00+00:00", "lies in the future"),
                                (("best", "updated"), "", "profiles[0].best.updated is not an ISO 8601 time"),
                                (("updated",), "9999-12-31T23:00:00-05:00", "is not an ISO 8601 time"),
                                (("created",), "0001-01-01T00:30:00+01:00", "is not an ISO 8601 time")):
        data = store.export([a])
        target = data["profiles"][0]
        for k in where[:-1]:
            target = target[k]
        target[where[-1]] = value
        with pytest.raises(InvalidExport, match=words.replace("[", r"\[").replace("]", r"\]")):
            ProfileStore(tmp_path / "fresh.sqlite").merge(data)
    data = store.export([a])
    data["profiles"][0]["created"] = "2026-11-01T10:00:00"
    data["profiles"][0]["trials"][0]["created"] = "2026-11-01T12:00:00.5+02:00"
    data["profiles"][0]["updated"] = "2026-11-02T08:00:00.25Z"  # (as JavaScript's toISOString writes)
    fresh = ProfileStore(tmp_path / "fresh.sqlite")
    fresh.merge(data)
    (p,) = fresh.export()["profiles"]
    uid = data["profiles"][0]["trials"][0]["uid"]
    assert p["created"] == "2026-11-01T10:00:00.000+00:00" and p["updated"] >= "2026-11-02T08:00:00.250+00:00"
    assert next(t for t in p["trials"] if t["uid"] == uid)["created"] == "2026-11-01T10:00:00.500+00:00"


def test_import_merges_trials_and_keeps_the_higher_best(store, tmp_path):
    a, _ = populated(store)
    other = ProfileStore(tmp_path / "other.sqlite")
    pid = new_profile(other)
    trial(other, pid, 130.0, run="elsewhere")
    other.set_best(pid, KNOBS, 130.0, 100.0, 0.02, "elsewhere")
    result = store.merge(other.export())
    assert result.profile_ids == [a] and (result.profiles_added, result.trials_added) == (0, 1)
    assert len(store.trials(a)) == 4 and store.best(KEY).run_id == "elsewhere"
    store.set_best(a, KNOBS, 200.0, 100.0, 0.02, "local")
    store.merge(other.export())
    assert store.best(KEY).run_id == "local"


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(format="other"), "not a tunelab profiles export"),
    (lambda d: d.update(version=3), "newer"),
    (lambda d: d["profiles"][0].pop("framework"), "framework is missing"),
    (lambda d: d["profiles"][0]["trials"][0].update(phase="warmup"), "phase"),
    (lambda d: d["profiles"][0]["trials"][0].update(score="fast"), "score"),
    # an empty key is one no store can hold or look up (every later tune would fail on it)
    (lambda d: d["profiles"][0].update(framework=""), r"profiles\[0\]\.framework is empty"),
    (lambda d: d["profiles"][1].update({k: d["profiles"][0][k] for k in
                                        ("hardware_hash", "model_signature", "framework", "world_size")}),
     "the key of an earlier profile"),
    # a uid names one trial: a second of the same uid would be dropped without a word
    (lambda d: d["profiles"][0]["trials"][1].update(uid=d["profiles"][0]["trials"][0]["uid"]),
     r"uid is also the uid of profiles\[0\]\.trials\[0\]"),
    (lambda d: d["profiles"][0]["best"].update(gain_low=2.0, gain_high=0.5, gain=None), "go together"),
    (lambda d: d["profiles"][0]["best"].update(gain_high=None, gain=None), "go together"),
    (lambda d: d["profiles"][0].update(model_name="\ud800"), "not valid text"),
])
def test_invalid_exports_are_rejected_without_writing(store, tmp_path, mutate, message):
    populated(store)
    data = store.export()
    mutate(data)
    fresh = ProfileStore(tmp_path / "fresh.sqlite")
    with pytest.raises(InvalidExport, match=message):
        fresh.merge(data)
    assert fresh.profiles() == []


def test_an_import_that_would_move_a_trial_to_another_profile_is_refused(store, tmp_path):
    """A trial's uid already here under one profile, given under another (a key edited by hand): the
    import is refused whole, rather than the new profile arriving without its trials."""
    a, _ = populated(store)
    data = store.export([a])
    data["profiles"][0]["world_size"] = 4
    before = store.export()
    with pytest.raises(InvalidExport, match=f"is a trial of profile {a} here"):
        store.merge(data)
    assert store.export() == before


def test_importing_over_a_damaged_best_names_the_profile(store, tmp_path):
    a, _ = populated(store)
    data = store.export([a])
    data["profiles"][0]["best"]["score"] = 500.0
    conn = sqlite3.connect(store.path)
    with conn:
        conn.execute("UPDATE best SET score = 'x' WHERE profile_id = ?", (a,))
    conn.close()
    with pytest.raises(StoreError, match=f"profile {a} is damaged"):
        store.merge(data)


def test_cli_import_of_a_deeply_nested_file_is_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    one_error_line(cli(tmp_path / "home", "import", str(deep)), 2, "nested too deeply")


def test_a_store_opened_to_read_does_not_write_after_a_newer_tunelab_upgraded_it(tmp_path):
    path = tmp_path / FILE_NAME
    pid = populated(ProfileStore(path))[0]
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")  # as an older file
    reader = ProfileStore(path, create=False)
    with conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")  # a newer tunelab, meanwhile
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="schema version 99, newer"):
        trial(reader, pid, 10.0)
    assert path.read_bytes() == before


# -- robustness ----------------------------------------------------------------------------------

def _writer(path, start, n):
    store = ProfileStore(path)
    pid = new_profile(store)
    start.wait(30)
    for i in range(n):
        trial(store, pid, float(i), run=f"pid{os.getpid()}")
    os._exit(0)


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / FILE_NAME
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, start, 50)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    store = ProfileStore(path)
    assert len(store.profiles()) == 1
    trials = store.trials(store.profiles()[0].id)
    assert len(trials) == 100 and len({t.uid for t in trials}) == 100
    assert len({t.run_id for t in trials}) == 2


def _endless_writer(path, pid):
    store = ProfileStore(path)
    while True:
        trial(store, pid, 1.0)


def test_killed_writer_leaves_every_finished_trial(tmp_path):
    path = tmp_path / FILE_NAME
    store = ProfileStore(path)
    pid = new_profile(store)
    proc = multiprocessing.get_context("fork").Process(target=_endless_writer, args=(path, pid))
    proc.start()
    deadline = time.monotonic() + 30
    while len(store.trials(pid)) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    seen = store.trials(pid)
    assert len(seen) >= 20 and all(t.score == 1.0 for t in seen)
    trial(store, pid, 2.0)
    assert len(store.trials(pid)) == len(seen) + 1


def _dies_mid_transaction(path, pid, n):
    store = ProfileStore(path)
    for _ in range(n):
        trial(store, pid, 1.0)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE trials SET score = -1")
    conn.execute("DELETE FROM profiles")
    os._exit(3)


def test_exit_inside_a_transaction_keeps_committed_trials(tmp_path):
    path = tmp_path / FILE_NAME
    store = ProfileStore(path)
    pid = new_profile(store)
    proc = multiprocessing.get_context("fork").Process(target=_dies_mid_transaction, args=(path, pid, 7))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 3
    after = ProfileStore(path)
    assert [t.score for t in after.trials(pid)] == [1.0] * 7


def _assert_refused(path, fragment):
    before = path.read_bytes()
    with pytest.raises(StoreError) as info:
        ProfileStore(path)
    message = str(info.value)
    assert str(path) in message and fragment in message and "\n" not in message
    assert path.read_bytes() == before
    return message


def test_corrupt_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / FILE_NAME
    path.write_bytes(np.random.default_rng(0).bytes(8192))
    _assert_refused(path, "not a tunelab profile store")


def test_damaged_sqlite_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / FILE_NAME
    ProfileStore(path)
    data = bytearray(path.read_bytes())
    data[100:] = np.random.default_rng(1).bytes(len(data) - 100)
    path.write_bytes(bytes(data))
    _assert_refused(path, "profile store")


def test_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE cats (name TEXT)")
    conn.close()
    _assert_refused(path, "not a tunelab profile store")


def test_newer_schema_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / FILE_NAME
    populated(ProfileStore(path))
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.close()
    assert "newer" in _assert_refused(path, "schema version 99")


def test_tunelab_home_location(tmp_path):
    assert tunelab_home({"TUNELAB_HOME": str(tmp_path)}) == tmp_path
    assert tunelab_home({"XDG_DATA_HOME": "/xdg", "HOME": "/h"}) == Path("/xdg/tunelab")
    assert tunelab_home({"XDG_DATA_HOME": "relative", "HOME": "/h"}) == Path("/h/.local/share/tunelab")
    assert tunelab_home({"HOME": "/h", "TUNELAB_HOME": ""}) == Path("/h/.local/share/tunelab")


# -- CLI -----------------------------------------------------------------------------------------

def cli(home, *args, stdin=subprocess.DEVNULL):
    env = {**os.environ, "TUNELAB_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "tunelab.cli", "profiles", *args], check=False,
                          capture_output=True, text=True, timeout=60, env=env, stdin=stdin)


def one_error_line(proc, code, fragment):
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunelab") and fragment in lines[0], proc.stderr


def test_cli_list_show_export_import_delete(tmp_path):
    home = tmp_path / "home"
    a, b = populated(ProfileStore(home / FILE_NAME))
    out = cli(home, "list")
    assert out.returncode == 0, out.stderr
    assert "best_samples/s" in out.stdout and "102.00" in out.stdout and "1.020" in out.stdout
    assert "resnet50" in out.stdout and "n/a" in out.stdout  # b has no best yet
    show = cli(home, "show", str(a))
    assert show.returncode == 0, show.stderr
    assert "cpu_model: AMD EPYC" in show.stdout and "segment_bytes: 3MiB" in show.stdout
    assert "trials: 3" in show.stdout and "segment_bytes=2MiB" in show.stdout
    assert "tuning: gain 1.020x [1.011, 1.030] (90 % interval), 57 steps to lock, converged" in show.stdout
    export = cli(home, "export", "--out", str(tmp_path / "x.json"))
    assert export.returncode == 0 and "2 profiles (4 trials)" in export.stdout
    assert json.loads(cli(home, "export", str(b)).stdout)["profiles"][0]["framework"] == "tensorflow"
    other = tmp_path / "other"
    imported = cli(other, "import", str(tmp_path / "x.json"))
    assert imported.returncode == 0 and "2 new profiles, 4 new trials" in imported.stdout
    assert "0 new profiles, 0 new trials" in cli(other, "import", str(tmp_path / "x.json")).stdout
    one_error_line(cli(home, "delete", str(a)), 2, "without --yes")
    assert ProfileStore(home / FILE_NAME).get(a) is not None
    deleted = cli(home, "delete", str(a), "--yes")
    assert deleted.returncode == 0 and "deleted profile" in deleted.stdout
    assert [p.id for p in ProfileStore(home / FILE_NAME).profiles()] == [b]


def test_reading_commands_create_no_store_and_a_later_write_does(tmp_path):
    home = tmp_path / "home"
    assert "# no profiles" in cli(home, "list").stdout
    one_error_line(cli(home, "show", "1"), 1, "no profile with id 1")
    one_error_line(cli(home, "delete", "1", "--yes"), 1, "no profile with id 1")
    assert json.loads(cli(home, "export").stdout)["profiles"] == []
    assert not home.exists()  # nothing made on disk for a store nobody wrote to
    reader = ProfileStore(home / FILE_NAME, create=False)
    assert reader.profiles() == [] and reader.best(KEY) is None and not home.exists()
    writer = ProfileStore(home / FILE_NAME)  # another process creates it: the reader sees what it writes
    pid = new_profile(writer)
    assert [p.id for p in reader.profiles()] == [pid]
    late = ProfileStore(tmp_path / "late" / FILE_NAME, create=False)
    assert trial(late, new_profile(late), 5.0) and (tmp_path / "late" / FILE_NAME).exists()  # a write creates it


def test_cli_errors_are_one_line(tmp_path):
    home = tmp_path / "home"
    populated(ProfileStore(home / FILE_NAME))
    one_error_line(cli(home, "show", "99"), 1, "no profile with id 99")
    one_error_line(cli(home, "delete", "99", "--yes"), 1, "no profile with id 99")
    one_error_line(cli(home, "export", "1", "99"), 1, "no profile with id 99")
    # the file the command names is missing or not an export: a usage error (exit 2)
    one_error_line(cli(home, "import", str(tmp_path / "nope.json")), 2, "cannot read")
    (tmp_path / "bad.json").write_text("{not json")
    one_error_line(cli(home, "import", str(tmp_path / "bad.json")), 2, "not valid JSON")
    (tmp_path / "wrong.json").write_text('{"format": "something"}')
    one_error_line(cli(home, "import", str(tmp_path / "wrong.json")), 2, "not a valid tunelab profiles export")
    one_error_line(cli(tmp_path / "fresh", "import", str(tmp_path / "wrong.json")), 2, "not a valid")
    assert not (tmp_path / "fresh").exists()  # refused before a store was made for it
    one_error_line(cli(home, "show", "abc"), 2, "expected a profile id")
    one_error_line(cli(home, "export", "--bogus"), 2, "unrecognized arguments")
    one_error_line(cli(home, "frobnicate"), 2, "invalid choice")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / FILE_NAME).write_bytes(b"\x00garbage" * 100)
    one_error_line(cli(corrupt, "list"), 1, "not a tunelab profile store")


@pytest.mark.parametrize(("column", "value", "fragment"), [
    ("profiles.hardware_facts", "{bad", "its hardware facts are not a JSON object"),
    ("trials.knobs", "[1]", "the knobs of its trial"),
    ("best.knobs", "3", "its best config's knobs are not a JSON object"),
    ("best.default_score", "0", "its best config's scores are not positive numbers"),
    ("best.gain", "'x'", "its best config's gain is not a positive number"),
    # (these passed the read and failed on use: a traceback in show, in a job rank 0's lookup only)
    ("best.gain_low", "x", "the gain_low of its best config is 'x'"),
    ("best.spread", "y", "the spread of its best config is 'y'"),
    ("best.gain_high", "0.5", "its best config's interval is [1.011, 0.5]"),
    ("best.steps", "z", "the steps of its best config is 'z'"),
])
def test_a_damaged_row_is_one_line_naming_the_profile_and_delete_recovers(tmp_path, column, value, fragment):
    home = tmp_path / "home"
    a, b = populated(ProfileStore(home / FILE_NAME))
    table, field = column.split(".")
    where = "id" if table == "profiles" else "profile_id"
    conn = sqlite3.connect(home / FILE_NAME)
    conn.execute(f"UPDATE {table} SET {field} = ? WHERE {where} = ?", (value, a))
    conn.commit()
    conn.close()
    before = (home / FILE_NAME).read_bytes()
    damaged = cli(home, "show", str(a))
    one_error_line(damaged, 1, f"profile {a} is damaged ({fragment}")
    assert damaged.stdout == "", damaged.stdout  # nothing of the profile printed before the error
    listed = cli(home, "list")  # the list goes on: the damaged row is listed as such
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    gains = [line.split()[-1] for line in listed.stdout.splitlines()[3:]]  # (a's row, then b's)
    assert gains == ["1.030]" if table == "trials" else "damaged", "n/a"], listed.stdout
    one_error_line(cli(home, "export"), 1, f"profiles delete {a} --yes")
    assert json.loads(cli(home, "export", str(b)).stdout)["profiles"][0]["framework"] == "tensorflow"
    assert (home / FILE_NAME).read_bytes() == before  # refused, not rewritten
    assert cli(home, "delete", str(a), "--yes").returncode == 0
    assert cli(home, "list").returncode == 0 and cli(home, "show", str(b)).returncode == 0


@pytest.mark.parametrize("outcome, line", [
    ("retuned: converged, default kept",
     ("tuning: gain: default kept (no configuration cleared the minimum gain), 30 steps to lock, converged, "
     "in a search a retune re-opened")),
    ("every knob is pinned", "tuning: gain: default kept (every knob was pinned), 30 steps to lock\n"),
    ("budget exhausted", ("tuning: gain: default kept (no configuration cleared the minimum gain), 30 steps to lock, "
                         "budget exhausted\n")),
])
def test_show_says_why_a_kept_default_was_kept(tmp_path, outcome, line):
    home = tmp_path / "home"
    store = ProfileStore(home / FILE_NAME)
    pid = store.upsert_profile(ProfileKey("h" * 16, "sig", "torch", 2), "host", {"cpu_model": "C"}, "m")
    store.record_trial(pid, {"segment_bytes": 1 << 20}, 10.0, 0.01, 3, 1.0, "r", "default")
    store.set_best(pid, {"segment_bytes": 1 << 20}, 10.0, 10.0, 0.01, "r", steps=30, outcome=outcome)
    show = cli(home, "show", str(pid))
    assert show.returncode == 0 and line in show.stdout, show.stdout


def test_cli_import_reads_past_a_byte_order_mark(tmp_path):
    """An export edited in an editor that saves UTF-8 with a byte order mark imports as it was."""
    home = tmp_path / "home"
    populated(ProfileStore(home / FILE_NAME))
    export = cli(home, "export")
    assert export.returncode == 0, export.stderr
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + export.stdout.encode())
    imported = cli(tmp_path / "other", "import", str(marked))
    assert imported.returncode == 0 and "2 new profiles, 4 new trials" in imported.stdout, imported.stderr


def test_a_retunes_check_blocks_are_stored_as_trials(tmp_path):
    """The watch of a locked configuration that claimed a gain checks it (the locked configuration's
    block between two of the default's) before it re-opens a search: each check block was handed to the
    store as phase "check", which the store refused with a ValueError that ended `tune --retune`
    (exit 1, its result lost) and, in a job's watch, stopped every later write."""
    from tunelab.knobs import Knobs
    from tunelab.tuning.driver import Driver
    from tunelab.tuning.plan import Plan
    from tunelab.tuning.run import _Recorder
    from tunelab.tuning.space import search_space
    from tunelab.tuning.stats import Interval
    from tunelab.tuning.strategies import make_strategy

    store = ProfileStore(tmp_path / "p.sqlite")
    pid = new_profile(store)
    recorder = _Recorder(store, pid, "run", KEY, None)
    space = search_space({}, 2)
    loaded = Knobs(cycle_time_ms=32.0)
    driver = Driver.watching(space, lambda e: make_strategy("tunelab", space, e), loaded,
                             Plan(retune=True, warmup_steps=1), on_sample=recorder.record,
                             interval=Interval(1.10, 1.05, 1.15, 3))
    for i in range(400):  # the host slows down 2x after 150 steps: the check runs, then a search
        driver.step_done(0.1 if i < 150 else 0.2)
    assert recorder.failed is None
    phases = [t.phase for t in store.trials(pid)]
    assert phases.count("check") >= 3, phases
    exported = store.export()
    assert exported["version"] == 2  # (an older tunelab says the export is newer than it reads)
    copy = ProfileStore(tmp_path / "q.sqlite")
    copy.import_(exported)  # the store's backup takes them too
    assert [t.phase for t in copy.trials(copy.profiles()[0].id)].count("check") >= 3


def test_a_store_write_gives_up_after_its_own_busy_timeout(tmp_path):
    """A job's retune writes on rank 0's training thread: a store another process holds locked must not
    keep it there for the store's 60 s (the others' gradients wait for it: a stall).  The watch's store
    waits at most a quarter of the job's timeout and of its stall warning, then its writer gives up,
    says so, and training goes on."""
    import sqlite3

    from tunelab.tuning.watch import StoreWriter

    store = ProfileStore(tmp_path / "p.sqlite")
    pid = new_profile(store)
    store.busy_timeout_s = 0.5
    lines = []
    writer = StoreWriter(store, pid, "retune-x", say=lines.append)
    holder = sqlite3.connect(tmp_path / "p.sqlite", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's write, in progress
    try:
        t0 = time.monotonic()
        ok = writer._write(lambda: store.record_trial(pid, KNOBS, 1.0, 0.01, 3, 1.0, "retune-x", "explore"))
        waited = time.monotonic() - t0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not ok and writer.broken and waited < 5, waited
    assert "locked by another process (waited 0.5 s)" in lines[0] and "training goes on" in lines[0], lines


# -- a store to read only, damaged rows, what a command cannot write ----------------------------

def _bound_by_file_modes():
    """A command prefix under which file modes bind this process's children as any user's (root's
    DAC override dropped): none needed for another user; root needs setpriv, else the test is skipped."""
    import shutil

    if os.geteuid() != 0:
        return []
    prefix = [shutil.which("setpriv") or "setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    try:
        works = subprocess.run([*prefix, "true"], check=False, capture_output=True, timeout=30).returncode == 0
    except OSError:
        works = False
    if not works:
        pytest.skip("root, and setpriv cannot drop the DAC override: file modes would not bind")
    return prefix


def test_a_read_only_store_loads_lists_shows_and_exports_and_a_write_says_where_it_cannot(tmp_path):
    """A site-wide store, or one baked into a container image: its directory and file read-only to the
    job's user.  Its WAL mode made every reader open it to write ("attempt to write a readonly database",
    a job then trained on the default knobs); now what only reads opens it read-only, and a write says
    that the directory is not writable, in one line."""
    prefix = _bound_by_file_modes()
    home = tmp_path / "site"
    store = ProfileStore(home / FILE_NAME)
    a, b = populated(store)
    expected = store.export()
    last = sqlite3.connect(home / FILE_NAME)  # (a reader leaves the WAL's side files; the last writer to close
    last.execute("SELECT COUNT(*) FROM meta").fetchone()  # removes them: an image's store has none to read by)
    last.close()
    assert (home / FILE_NAME).read_bytes()[18:20] == b"\x02\x02"  # (WAL mode, as every store is)
    assert sorted(p.name for p in home.iterdir()) == [FILE_NAME]
    before = (home / FILE_NAME).read_bytes()
    env = {**os.environ, "TUNELAB_HOME": str(home)}

    def run(*args):
        return subprocess.run([*prefix, sys.executable, *args], check=False, capture_output=True, text=True,
                              timeout=60, env=env, stdin=subprocess.DEVNULL)

    lookup = ("from types import SimpleNamespace as N; from tunelab.runtime import Runtime; "
              "from tunelab.config import load_engine_config; from tunelab.profiles import ProfileKey; "
              f"key = ProfileKey(*{KEY.params()!r}); "
              "job = N(topology=N(size=2), config=load_engine_config({}), _knobs_from='', "
              "profile_keys=lambda s, f, l=None: [key]); print(Runtime._lookup_profile(job, key.model_signature, 'torch', 'r')[0])")
    (tmp_path / "x.json").write_text(json.dumps(expected))
    (home / FILE_NAME).chmod(0o444)
    home.chmod(0o555)
    try:
        job = run("-c", lookup)
        listed, shown = run("-m", "tunelab.cli", "profiles", "list"), run("-m", "tunelab.cli", "profiles", "show", str(a))
        exported = run("-m", "tunelab.cli", "profiles", "export")
        deleted = run("-m", "tunelab.cli", "profiles", "delete", str(b), "--yes")
        imported = run("-m", "tunelab.cli", "profiles", "import", str(tmp_path / "x.json"))
        left = sorted(p.name for p in home.iterdir())
    finally:
        home.chmod(0o755)
        (home / FILE_NAME).chmod(0o644)
    assert job.stdout.startswith(f"tunelab: loaded tuned profile {a} for r / torch / 2 ranks: "), (job.stdout, job.stderr)
    assert listed.returncode == 0 and listed.stdout.startswith("# 2 profiles in"), listed.stderr
    assert shown.returncode == 0 and "segment_bytes: 3MiB" in shown.stdout, shown.stderr
    assert exported.returncode == 0 and json.loads(exported.stdout) == expected, exported.stderr
    for proc in (deleted, imported):
        assert proc.returncode == 1 and proc.stdout == "", proc.stdout
        assert proc.stderr == f"tunelab: error: the profile store's directory is not writable: {home}\n", proc.stderr
    assert left == [FILE_NAME] and (home / FILE_NAME).read_bytes() == before


def test_a_read_only_store_whose_write_ahead_log_holds_changes_says_so_rather_than_reading_without_them(tmp_path):
    """Copied while a writer had changes in its write-ahead log (the -wal file, no -shm beside it) into a
    read-only directory: SQLite cannot apply that log there, and read "immutable" the file alone would
    lack the changes (a profile's old best, silently); so a reader refuses in one line, saying what to do."""
    prefix = _bound_by_file_modes()
    source, site = tmp_path / "source", tmp_path / "site"
    a, _ = populated(ProfileStore(source / FILE_NAME))
    writer = sqlite3.connect(source / FILE_NAME)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("UPDATE profiles SET model_name = 'renamed' WHERE id = ?", (a,))
    writer.commit()
    site.mkdir()
    for name in (FILE_NAME, f"{FILE_NAME}-wal"):  # (as an image build might copy them, the writer still open)
        (site / name).write_bytes((source / name).read_bytes())
    writer.close()
    assert (site / f"{FILE_NAME}-wal").stat().st_size > 0 and not (site / f"{FILE_NAME}-shm").exists()
    site.chmod(0o555)
    try:
        listed = subprocess.run([*prefix, sys.executable, "-m", "tunelab.cli", "profiles", "list"], check=False,
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                                env={**os.environ, "TUNELAB_HOME": str(site)})
    finally:
        site.chmod(0o755)
    assert listed.returncode == 1 and listed.stdout == "", (listed.stdout, listed.stderr)
    assert listed.stderr.startswith(f"tunelab: error: {site / FILE_NAME}: its write-ahead log {FILE_NAME}-wal "
                                    "holds changes"), listed.stderr
    assert len(listed.stderr.splitlines()) == 1


def test_one_damaged_row_leaves_the_other_profiles_usable(tmp_path):
    """A profile whose facts are not an object (or whose world size is 0) made `export A` fail naming it,
    `list` fail, and `tune` fail (it looked its key up among every summary, and its seed among them):
    now an export reads only the profiles it names, `list` shows the row as damaged, a lookup by key
    and the seed leave it out, and its key is the store's "damaged" error, never a bare ValueError."""
    from tunelab.profile_records import DamagedProfileError
    from tunelab.tuning.run import _profile_id

    home = tmp_path / "home"
    store = ProfileStore(home / FILE_NAME)
    a, b = populated(store)
    c = new_profile(store, ProfileKey(KEY.hardware_hash, KEY.model_signature, "torch", 4))  # (a seed of a's model)
    expected = store.export([a])
    conn = sqlite3.connect(home / FILE_NAME)
    with conn:
        conn.execute("UPDATE profiles SET hardware_facts = '[1]' WHERE id = ?", (b,))
        conn.execute("UPDATE profiles SET world_size = 0 WHERE id = ?", (c,))
    conn.close()
    exported = cli(home, "export", str(a))
    assert exported.returncode == 0 and json.loads(exported.stdout) == expected, exported.stderr
    listed = cli(home, "list")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[3:]]
    assert [(r[0], r[-1]) for r in rows] == [(str(a), "1.030]"), (str(b), "damaged"), (str(c), "damaged")]
    assert rows[2][4] == "0"  # (its world size as stored)
    one_error_line(cli(home, "show", str(b)), 1, f"profile {b} is damaged (its hardware facts are not a JSON object")
    one_error_line(cli(home, "show", str(c)), 1, f"profile {c} is damaged (its world_size is 0")
    assert [s.id for s in store.profiles()] == [a]
    assert store.id_of(KEY) == a and _profile_id(store, KEY) == a  # (tune's lookup of its key)
    assert store.nearest(ProfileKey(KEY.hardware_hash, KEY.model_signature, "torch", 8)).id == a
    import dataclasses

    with pytest.raises(DamagedProfileError, match=f"profile {a} is damaged"):
        dataclasses.replace(store.get(a), world_size=0).key  # noqa: B018


def test_an_import_whose_best_does_not_name_every_knob_is_refused(tmp_path):
    """A best of ``{}`` imported, and a job applied nothing of it under its claimed gain: a best names
    every knob it ran with (those added since the first profiles were stored may be missing: it ran
    without them), else the import is refused as any invalid export (exit 2), before a store is made."""
    store = ProfileStore(tmp_path / "home" / FILE_NAME)
    a, _ = populated(store)  # (its best names the knobs of before the one-shot and doubling knobs)
    every = "'fusion_threshold_bytes', 'cycle_time_ms', 'hierarchical', 'group_fusion', 'segment_bytes'"
    for knobs, missing in (({}, every),
                           ({k: v for k, v in KNOBS.items() if k != "cycle_time_ms"}, "'cycle_time_ms'")):
        data = store.export([a])
        data["profiles"][0]["best"]["knobs"] = knobs
        (tmp_path / "x.json").write_text(json.dumps(data))
        one_error_line(cli(tmp_path / "other", "import", str(tmp_path / "x.json")), 2,
                       f"profiles[0].best.knobs lacks {missing}: a best config names every knob it was measured with")
        assert not (tmp_path / "other").exists()
    (tmp_path / "x.json").write_text(json.dumps(store.export([a])))
    assert cli(tmp_path / "other", "import", str(tmp_path / "x.json")).returncode == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_output_that_cannot_be_written_is_one_error_line(tmp_path, unbuffered):
    """`profiles export > /dev/full` (a full disk, a quota) printed a traceback: now one line, exit 1."""
    import errno

    home = tmp_path / "home"
    a, _ = populated(ProfileStore(home / FILE_NAME))
    env = {**os.environ, "TUNELAB_HOME": str(home), "PYTHONUNBUFFERED": unbuffered}
    for args in (["export"], ["list"], ["show", str(a)]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "profiles", *args], check=False, stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=60, env=env)
        assert proc.returncode == 1 and proc.stderr == ("tunelab: error: cannot write standard output: "
                                                        f"{os.strerror(errno.ENOSPC)}\n"), (args, proc.stderr)


def test_a_profile_id_is_ascii_digits_only(tmp_path):
    """`profiles delete 1_2 --yes` deleted profile 12 (int() reads "1_2", "١٢" and " 12" as 12)."""
    home = tmp_path / "home"
    store = ProfileStore(home / FILE_NAME)
    ids = [new_profile(store, ProfileKey(KEY.hardware_hash, KEY.model_signature, "torch", n)) for n in range(1, 13)]
    assert ids[-1] == 12
    for text in ("1_2", "١٢", " 12", "+12", "12.0"):
        one_error_line(cli(home, "delete", text, "--yes"), 2, f"expected a profile id (a positive integer), got {text!r}")
        one_error_line(cli(home, "show", text), 2, "expected a profile id")
    assert [s.id for s in store.profiles()] == ids
    assert cli(home, "delete", "012", "--yes").returncode == 0 and store.get(12) is None


def test_with_no_home_the_store_has_no_place_and_a_command_that_needs_it_says_so(tmp_path):
    """A container under a uid with no passwd entry and no HOME: `tunelab profiles list` printed a
    RuntimeError's traceback; it is a usage error now (set TUNELAB_HOME), one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "TUNELAB_HOME", "XDG_DATA_HOME")}
    script = ("import pwd, sys\n"
              "def no_entry(uid):\n    raise KeyError(uid)\n"
              "pwd.getpwuid = no_entry\n"
              "from tunelab.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    for args in (["list"], ["show", "1"], ["export"]):
        proc = subprocess.run([sys.executable, "-c", script, "profiles", *args], check=False, capture_output=True,
                              text=True, timeout=60, env=env, cwd=tmp_path)
        one_error_line(proc, 2, "cannot locate the profile store: HOME is unset and this user (uid ")
        assert proc.stderr.rstrip().endswith("set TUNELAB_HOME to a directory for it"), proc.stderr
