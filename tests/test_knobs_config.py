import pytest

from tunelab.config import load_engine_config
from tunelab.knobs import SPECS, Knobs
from tunelab.units import format_size, parse_size


def test_defaults_are_valid_and_replace_validates():
    k = Knobs()
    assert k.fusion_threshold_bytes == 64 << 20
    assert k.replace(cycle_time_ms=5).cycle_time_ms == 5.0
    with pytest.raises(ValueError, match=r"cycle_time_ms=0 is out of range 0.05 \.\. 1000"):
        k.replace(cycle_time_ms=0)
    with pytest.raises(ValueError, match=r"fusion_threshold_bytes=-1 is out of range 0B \.\. 1GiB"):
        Knobs(fusion_threshold_bytes=-1)
    with pytest.raises(ValueError, match="segment_bytes must be a number"):
        Knobs(segment_bytes="lots")
    with pytest.raises(ValueError, match="hierarchical must be true or false"):
        Knobs(hierarchical="maybe")
    with pytest.raises(ValueError, match="unknown knob 'fusion_mb'"):
        k.replace(fusion_mb=3)
    assert Knobs(segment_bytes="1MiB", hierarchical="on").segment_bytes == 1 << 20


def test_every_knob_has_a_help_text_and_range():
    for spec in SPECS.values():
        assert spec.help and spec.describe_range()


@pytest.mark.parametrize("text,value", [("4096", 4096), ("1KiB", 1024), ("64MiB", 64 << 20),
                                        ("1GiB", 1 << 30), ("2k", 2048), ("0.5MiB", 1 << 19)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12XB", "", "MiB", "-1", "1.3B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (1024, 64 << 20, 1000, 3 << 30)] == ["1KiB", "64MiB", "1000B", "3GiB"]


def test_precedence_explicit_over_scenario_over_env_over_default():
    env = {"TUNELAB_FUSION_THRESHOLD_BYTES": "1MiB", "TUNELAB_CYCLE_TIME_MS": "7",
           "TUNELAB_RANKS_PER_NODE": "2", "UNRELATED": "x"}
    cfg = load_engine_config(env, scenario={"cycle_time_ms": 3}, segment_bytes=8192)
    assert cfg.knobs.fusion_threshold_bytes == 1 << 20  # env
    assert cfg.knobs.cycle_time_ms == 3.0                # scenario beats env
    assert cfg.knobs.segment_bytes == 8192               # explicit
    assert cfg.knobs.hierarchical is False               # default
    assert cfg.ranks_per_node == 2
    assert cfg.pinned == {"fusion_threshold_bytes", "cycle_time_ms", "segment_bytes"}
    assert load_engine_config({}, cycle_time_ms=None).pinned == frozenset()


def test_bad_environment_values_name_the_setting():
    with pytest.raises(ValueError, match="cycle_time_ms"):
        load_engine_config({"TUNELAB_CYCLE_TIME_MS": "fast"})
    with pytest.raises(ValueError, match="ranks_per_node"):
        load_engine_config({"TUNELAB_RANKS_PER_NODE": "0"})
    for value in (2.5, True):  # (were read as 2 and 1)
        with pytest.raises(ValueError, match=f"ranks_per_node must be a positive integer, got {value}"):
            load_engine_config({}, ranks_per_node=value)
    assert load_engine_config({}, ranks_per_node=2.0).ranks_per_node == 2


def test_the_timeout_leaves_room_for_a_slow_rank_and_a_warning_comes_long_before_it():
    """A rank evaluating or saving alone must not end the job by default (torch.distributed waits 10
    minutes); the warning (Horovod's 60 s) is its own setting, from the environment or init()."""
    cfg = load_engine_config({})
    assert (cfg.timeout_s, cfg.stall_warning_s) == (600.0, 60.0)
    cfg = load_engine_config({"TUNELAB_TIMEOUT_S": "30", "TUNELAB_STALL_WARNING_S": "2.5"})
    assert (cfg.timeout_s, cfg.stall_warning_s) == (30.0, 2.5)
    assert load_engine_config({"TUNELAB_STALL_WARNING_S": "2.5"}, stall_warning_s=9).stall_warning_s == 9.0
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match=r"TUNELAB_STALL_WARNING_S='.*': stall_warning_s must be a number > 0"):
            load_engine_config({"TUNELAB_STALL_WARNING_S": bad})


def test_emulated_link_settings_are_checked():
    cfg = load_engine_config({"TUNELAB_RANKS_PER_NODE": "2", "TUNELAB_LINK_GBPS": "25",
                              "TUNELAB_LINK_LATENCY_US": "5"})
    assert (cfg.link_gbps, cfg.link_latency_us) == (25.0, 5.0)
    assert load_engine_config({}).link_gbps is None
    with pytest.raises(ValueError, match="set ranks_per_node too"):
        load_engine_config({}, link_gbps=10)
    for bad in ("0", "-1", "fast", "nan", "inf"):
        with pytest.raises(ValueError, match="link_gbps must be a number > 0"):
            load_engine_config({"TUNELAB_LINK_GBPS": bad}, ranks_per_node=2)
    with pytest.raises(ValueError, match="link_latency_us must be a number >= 0"):
        load_engine_config({}, ranks_per_node=2, link_gbps=1, link_latency_us=-1)


def test_an_environment_setting_is_checked_only_where_nothing_overrides_it():
    from tunelab.config import EnvironmentSettingError, load_engine_config

    env = {"TUNELAB_HIERARCHICAL": "maybe", "TUNELAB_RANKS_PER_NODE": ""}
    with pytest.raises(EnvironmentSettingError, match=r"^TUNELAB_HIERARCHICAL='maybe': "):
        load_engine_config(env)
    cfg = load_engine_config(env, hierarchical=True)  # an explicit value outranks the environment's
    assert cfg.knobs.hierarchical is True and cfg.ranks_per_node is None  # an empty variable is unset
    assert load_engine_config(env, scenario={"hierarchical": False}).knobs.hierarchical is False


def test_knob_text_is_what_knob_flags_take_back():
    """Every command prints knobs through knob_text; its exact form parses back to the same value."""
    from tunelab.knobs import Knobs, knob_text

    odd = Knobs(fusion_threshold_bytes=0, cycle_time_ms=4.346, hierarchical=True, segment_bytes=69712 * 1024,
                oneshot_max_bytes=0, doubling_max_bytes=48 * 1024)
    texts = {name: knob_text(name, value) for name, value in odd.as_dict().items()}
    assert texts == {"fusion_threshold_bytes": "off", "cycle_time_ms": "4.346", "hierarchical": "on",
                     "group_fusion": "on", "segment_bytes": "69712KiB", "oneshot_max_bytes": "off",
                     "doubling_max_bytes": "48KiB"}
    assert Knobs(**texts) == odd  # "off" and "on" read back
    assert knob_text("segment_bytes", 69712 * 1024, exact=False) == "68.1MiB"
    assert knob_text("cycle_time_ms", 1.0) == "1"
    with pytest.raises(ValueError, match="segment_bytes"):
        Knobs(segment_bytes="off")  # a size that has no "off"


def test_an_emulated_links_latency_overlaps_pieces_sent_back_to_back():
    """Four 12.5 KB pieces at 1 Gb/s (0.1 ms each on the wire) sent together behind 20 ms of latency
    arrive 20.4 ms after they were sent, as on a real link: the wire is not idle while a piece is in
    flight.  (The emulation charged the latency one piece after another: 80 ms, which made small
    segments look 10-20x slower than the link behind an emulated latency.)"""
    import time

    from mpi4py import MPI

    from tunelab.engine.link import EmulatedLink

    link = EmulatedLink(MPI.COMM_SELF, gbps=1.0, latency_us=20_000)
    try:
        sent = time.monotonic()
        for _ in range(4):
            link.transfer(12_500, sent)
        assert 0.0199 < link.seconds_waited < 0.03, link.seconds_waited
        assert link.bytes_through == 50_000
    finally:
        link.close()


def test_a_timeline_path_keeps_braces_other_than_rank(tmp_path):
    """``{rank}`` is filled in and any other brace is part of the name (``str.format`` read ``{x}`` as a
    field: ``TUNELAB_TIMELINE=tl-{rank}-{x}.json`` failed every rank with ``KeyError: 'x'``)."""
    from tunelab.engine.timeline import Timeline

    for rank in (0, 1):
        tl = Timeline.for_rank(str(tmp_path / "tl-{rank}-{x}-{0}-{.json"), rank)
        tl.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl-0-{x}-{0}-{.json", "tl-1-{x}-{0}-{.json"]
    assert Timeline.for_rank(str(tmp_path / "only-rank-0-{x}.json"), 1) is None
