"""What a training job loads from the profile store: the knobs a stored profile was measured with, a
job with nowhere to look for the store, and the profile setting (``TUNELAB_PROFILE``)."""

import time
from types import SimpleNamespace

import pytest
from mpi_harness import run_ok

from tunelab.config import EnvironmentSettingError, load_engine_config
from tunelab.errors import UsageError
from tunelab.knobs import Knobs
from tunelab.profiles import ProfileKey, ProfileStore
from tunelab.runtime import Runtime

KEY = ProfileKey("h" * 16, "m", "torch", 2)
# a configuration stored before the one-shot and recursive-doubling knobs existed: it names neither
OLD = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 5.0, "hierarchical": False, "group_fusion": True,
       "segment_bytes": 1 << 20}


def fake_job(pinned=(), profile="auto", size=2, key=KEY, legacy_hash=""):
    """What ``Runtime._lookup_profile`` and ``_chosen_profile`` use of a job, without MPI: its keys come
    from the runtime's own ``profile_keys``, over a fingerprint of ``key``'s hash (and ``legacy_hash``,
    the hash of before 2026-11-29)."""
    chosen = {} if profile == "auto" else {"profile": profile}
    config = load_engine_config({}, **chosen, **{k: getattr(Knobs(), k) for k in pinned})
    job = SimpleNamespace(topology=SimpleNamespace(size=size), config=config, _knobs_from="",
                          fingerprint=lambda framework=None: SimpleNamespace(
                              hash=key.hardware_hash, legacy_hash=legacy_hash, name="host", facts={}))
    job.profile_keys = lambda *args: Runtime.profile_keys(job, *args)
    job.profile_key = lambda *args: Runtime.profile_key(job, *args)
    return job


def test_a_profile_stored_before_a_knob_existed_applies_the_knobs_it_was_measured_with(tmp_path, monkeypatch):
    """Its tuning ran with no one-shot and no recursive doubling (0: every bucket two-shot, every size the
    ring): those are applied with the rest of what was measured, not today's 1 MiB and 32 KiB defaults
    under the gain it claims; a knob the job pins stays the job's."""
    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path))
    store = ProfileStore()
    pid = store.upsert_profile(KEY, "host", {}, "tiny")
    store.set_best(pid, OLD, 120.0, 100.0, 0.01, "r", gain_interval=(1.2, 1.1, 1.3), steps=9, outcome="converged")
    line, knobs, _ = Runtime._lookup_profile(fake_job(), "m", "torch", "tiny")
    assert knobs == {**OLD, "oneshot_max_bytes": 0, "doubling_max_bytes": 0}
    assert "oneshot_max_bytes=off, doubling_max_bytes=off (measured 1.200x [1.100, 1.300] the default)" in line
    line, knobs, _ = Runtime._lookup_profile(fake_job(pinned=("oneshot_max_bytes",)), "m", "torch", "tiny")
    assert knobs == {**OLD, "doubling_max_bytes": 0}  # (pinned: not in what the job applies)
    # one whose tuning kept the default: that run had no such routes, today's default has them
    store.set_best(pid, OLD, 100.0, 100.0, 0.01, "r", steps=9, outcome="budget exhausted, default kept")
    line, knobs, _ = Runtime._lookup_profile(fake_job(), "m", "torch", "tiny")
    assert knobs["oneshot_max_bytes"] == 1 << 20 and knobs["doubling_max_bytes"] == 32 << 10
    assert "its oneshot_max_bytes=off (stored before that knob existed) is 1MiB now" in line, line


def test_a_profile_stored_under_the_hardware_hash_of_before_loads_and_moves_at_the_next_tune(tmp_path, monkeypatch):
    """Profiles stored before 2026-11-29 are keyed by a hash of every installed framework's full version
    and the GPU driver: a job finds one under that hash (after today's key, and after the model's earlier
    signature under today's hash), and its model's next ``tune`` moves it, trials and best, to today's key."""
    from tunelab.tuning.run import _Recorder

    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path))
    store = ProfileStore()
    old_key = ProfileKey("L" * 16, "m", "torch", 2)
    pid = store.upsert_profile(old_key, "host", {}, "tiny")
    store.record_trial(pid, Knobs(cycle_time_ms=3.0).as_dict(), 110.0, 0.01, 3, 1.0, "r", "explore")
    store.set_best(pid, Knobs(cycle_time_ms=3.0).as_dict(), 110.0, 100.0, 0.01, "r", gain_interval=(1.1, 1.05, 1.15))
    job = fake_job(legacy_hash="L" * 16)
    assert [k.hardware_hash + "/" + k.model_signature for k in job.profile_keys("m", "torch", "m-old")] == [
        f"{KEY.hardware_hash}/m", f"{KEY.hardware_hash}/m-old", f"{'L' * 16}/m", f"{'L' * 16}/m-old"]
    line, knobs, stored_as = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert knobs["cycle_time_ms"] == 3.0 and stored_as == old_key, line
    assert Runtime._lookup_profile(fake_job(), "m", "torch", "tiny")[1] is None  # (without it: not found)
    workload = SimpleNamespace(signature="m", legacy_signature="m", name="tiny")
    params = {"framework": "torch", "workload": "train"}
    read = _Recorder.create(params, job, workload, write=False)  # --no-store: read where it is, moved nowhere
    assert read.profile_id == pid and read.key == old_key and store.id_of(old_key) == pid
    tuned = _Recorder.create(params, job, workload)
    new_key = ProfileKey(KEY.hardware_hash, "m", "torch", 2)
    assert tuned.profile_id == pid and tuned.key == new_key
    assert store.id_of(new_key) == pid and store.id_of(old_key) is None
    assert len(store.trials(pid)) == 1 and store.best(new_key).knobs["cycle_time_ms"] == 3.0


def test_a_job_with_no_home_to_find_the_store_in_warns_and_uses_the_default_knobs(tmp_path, monkeypatch):
    """A container under a uid with no passwd entry and no HOME: the lookup is a one-line warning (a
    job trains on), not a RuntimeError raised on every rank; so is a TUNELAB_HOME of an unknown ~user."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("HOME", "TUNELAB_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    line, knobs, _ = Runtime._lookup_profile(fake_job(), "m", "torch", "tiny")
    assert knobs is None and line.startswith("tunelab: warning: cannot locate the profile store: HOME is unset")
    assert line.endswith("set TUNELAB_HOME to a directory for it; using default knobs"), line
    monkeypatch.setenv("TUNELAB_HOME", "~no-such-user-here/tunelab")
    line, knobs, _ = Runtime._lookup_profile(fake_job(), "m", "torch", "tiny")
    assert knobs is None and line == ("tunelab: warning: TUNELAB_HOME=~no-such-user-here/tunelab: no such user as "
                                      "'~no-such-user-here' to expand; using default knobs")


def test_the_profile_setting_is_auto_off_or_an_id_and_a_bad_one_names_the_variable():
    assert load_engine_config({}).profile == "auto"
    assert load_engine_config({"TUNELAB_PROFILE": ""}).profile == "auto"  # (empty: unset, as every setting)
    assert load_engine_config({"TUNELAB_PROFILE": "OFF"}).profile == "off"
    assert load_engine_config({"TUNELAB_PROFILE": "12"}).profile == 12
    assert load_engine_config({"TUNELAB_PROFILE": "off"}, profile=3).profile == 3  # (explicit wins)
    for bad in ("0", "1_2", "-3", "١٢", "latest", "3.0"):
        with pytest.raises(EnvironmentSettingError) as err:
            load_engine_config({"TUNELAB_PROFILE": bad})
        assert str(err.value).startswith(f"TUNELAB_PROFILE={bad!r}: profile must be auto, off or a profile id")
        assert isinstance(err.value, UsageError)  # (exit 2 from a command)


def test_a_profile_chosen_by_id_loads_whatever_its_key_but_not_at_another_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path))
    store = ProfileStore()
    other = store.upsert_profile(ProfileKey("o" * 16, "other-model", "torch", 2), "other host", {}, "big")
    bigger = store.upsert_profile(ProfileKey(KEY.hardware_hash, "m", "torch", 4), "host", {}, "tiny")
    empty = store.upsert_profile(ProfileKey(KEY.hardware_hash, "m", "tensorflow", 2), "host", {}, "tiny")
    for pid in (other, bigger):
        store.set_best(pid, Knobs(cycle_time_ms=3.0).as_dict(), 120.0, 100.0, 0.01, "r", gain_interval=(1.2, 1.1, 1.3))
    line, knobs, stored_as = Runtime._chosen_profile(fake_job(profile=other), other, "m", "torch", "tiny")
    warning, loaded = line.split("\n")
    assert warning == (f"tunelab: warning: TUNELAB_PROFILE={other}: profile {other} was tuned for the model big "
                       "[other-model], not this job's tiny [m]; the hardware other host [oooooooooooooooo], not "
                       "this job's [hhhhhhhhhhhhhhhh]: loaded as the setting asks")
    assert loaded.startswith(f"tunelab: loaded tuned profile {other} for tiny / torch / 2 ranks")
    assert knobs["cycle_time_ms"] == 3.0 and stored_as is None  # (another key's: not this job's to retune)
    with pytest.raises(UsageError) as err:
        Runtime._chosen_profile(fake_job(profile=bigger), bigger, "m", "torch", "tiny")
    assert str(err.value) == (f"TUNELAB_PROFILE={bigger}: profile {bigger} was tuned for 4 ranks, and this job has 2: "
                              "its knobs were measured at another size (unset TUNELAB_PROFILE to look up this "
                              "job's own)")
    with pytest.raises(UsageError, match=f"TUNELAB_PROFILE={empty}: profile {empty} has no tuned configuration"):
        Runtime._chosen_profile(fake_job(profile=empty), empty, "m", "tensorflow", "tiny")
    with pytest.raises(UsageError, match="TUNELAB_PROFILE=99: no profile with id 99 in "):
        Runtime._chosen_profile(fake_job(profile=99), 99, "m", "torch", "tiny")


@pytest.mark.mpi
def test_jobs_with_no_home_or_a_chosen_profile_train_or_fail_alike_on_every_rank(tmp_path):
    """Without HOME and a passwd entry every rank raised at optimizer creation; now rank 0 warns and the
    job trains with the default knobs.  A profile id of another world size is refused on every rank at
    once; another model's is warned about and applied on every rank, once a job; ``load_profile=False``
    wins over the setting; off looks nothing up (the job's own profile stays unloaded), said once."""
    start = time.monotonic()
    r0, r1 = run_ok("torch_profile_setting", 2, limit_s=200, env_home=str(tmp_path / "home"))
    assert time.monotonic() - start < 120  # (a rank waiting out its timeout would take minutes)
    defaults = {"cycle_time_ms": 10.0, "segment_bytes": 4 << 20}
    ids = r0["ids"]
    log, raised, knobs = r0["no_home"]
    assert log.startswith("tunelab: warning: cannot locate the profile store: HOME is unset") and raised is None, log
    assert log.endswith("using default knobs") and "\n" not in log and knobs == defaults
    assert r1["no_home"] == ["", None, defaults]
    for r in (r0, r1):
        assert r["bigger"][1] == (f"UsageError: TUNELAB_PROFILE={ids['bigger']}: profile {ids['bigger']} was tuned "
                                  "for 4 ranks, and this job has 2: its knobs were measured at another size (unset "
                                  "TUNELAB_PROFILE to look up this job's own)")
        assert r["bigger"][2] == defaults and r["bigger_s"] < 30
        assert r["not_loaded"] == ["", None, defaults]
        assert r["other"][1] is None and r["other"][2] == {"cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
        assert r["other_again"] == ["", None, {"cycle_time_ms": 3.0, "segment_bytes": 1 << 16}]
        assert r["off"][1] is None and r["off"][2] == defaults  # (its own profile's 5 ms not applied)
        assert r["off_again"] == ["", None, defaults]
    warning, loaded = r0["other"][0].split("\n")
    assert warning.startswith(f"tunelab: warning: TUNELAB_PROFILE={ids['other']}: profile {ids['other']} was "
                              "tuned for the model other [other-model-sig], not this job's tiny")
    assert loaded.startswith(f"tunelab: loaded tuned profile {ids['other']} for tiny / torch / 2 ranks")
    assert r0["off"][0] == "tunelab: TUNELAB_PROFILE=off: no tuned profile is looked up; training with the knobs as given"
    assert r1["other"][0] == r1["off"][0] == ""
