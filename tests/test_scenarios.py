"""Scenario files: the shipped ones load, broken ones fail with one line naming file and key."""

import dataclasses
from pathlib import Path

import pytest

from tunelab.errors import ScenarioError, TunelabError
from tunelab.scenarios import Scenario, list_scenarios, load_scenario, scenario_dirs, scenario_path

SHIPPED = {"resnet50", "resnet50-tf", "vgg16", "vgg16-tf", "bert", "bert-tf",
           "replay-resnet50", "replay-vgg16", "replay-vgg16-2nodes", "replay-bert", "resnet50-2nodes",
           "resnet50-lab", "replay-resnet50-lab"}
HEADER = 'workload = "train"\nmodel = "resnet50"\n'
REPLAY = 'workload = "replay"\nmodel = "resnet50"\n'
MiB = 1 << 20


def write(tmp_path: Path, text: str, name: str = "broken.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_list_scenarios_names_every_shipped_file_sorted():
    names = list_scenarios()
    assert names == sorted(names) and set(names) == SHIPPED


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_scenario_loads_by_name_and_by_path(name):
    scenario = load_scenario(name)
    assert scenario.name == name and Path(scenario.path).name == f"{name}.toml"
    assert load_scenario(scenario.path) == scenario == load_scenario(Path(scenario.path))
    assert scenario.framework == ("tensorflow" if name.endswith("-tf") else "torch")
    assert scenario.workload == ("replay" if name.startswith("replay-") else "train")


def test_shipped_scenarios_carry_their_specific_settings():
    assert dataclasses.asdict(load_scenario("resnet50")) | {"path": None} == dataclasses.asdict(
        Scenario("resnet50", "train", "resnet50", budget_samples=20, time_budget_s=120.0))
    two_nodes = load_scenario("resnet50-2nodes")
    assert (two_nodes.np, two_nodes.ranks_per_node) == (4, 2)
    bert = load_scenario("bert")
    assert (bert.model, bert.seq_len, bert.batch_size) == ("bert", 64, 4)
    replay = load_scenario("replay-resnet50")
    assert (replay.replay_forward_ms, replay.replay_backward_ms) == (100.0, 250.0)
    assert load_scenario("replay-vgg16").model == "vgg16"
    assert any(d.is_dir() for d in scenario_dirs())


def test_the_linked_two_node_replay_scenario_emulates_its_network():
    s = load_scenario("replay-vgg16-2nodes")
    assert (s.np, s.ranks_per_node, s.link_gbps, s.link_latency_us) == (4, 2, 10.0, 0.0)
    assert s.with_overrides(link_gbps=25, link_latency_us=3).link_gbps == 25.0


def test_a_complete_file_with_pinned_knobs_is_normalised(tmp_path):
    path = write(tmp_path, HEADER + 'framework = "tensorflow"\n[run]\nnp = 3\nranks_per_node = 1\n'
                 '[data]\nimage_size = 32\nbatch_size = 2\n[tuning]\ntime_budget_s = 90\nmeasure_steps = 5\nblock_seconds = 2\n'
                 '[knobs]\nfusion_threshold_bytes = "64MiB"\nhierarchical = true\ncycle_time_ms = 2\n'
                 '', name="mine.toml")
    s = load_scenario(str(path))
    assert s.name == "mine"  # from the file name when not given
    assert (s.framework, s.np, s.ranks_per_node, s.image_size, s.batch_size) == ("tensorflow", 3, 1, 32, 2)
    assert s.time_budget_s == 90.0 and isinstance(s.time_budget_s, float) and s.measure_steps == 5
    assert s.block_seconds == 2.0 and s.as_params()["block_seconds"] == 2.0
    assert s.knobs == {"fusion_threshold_bytes": 64 * MiB, "hierarchical": True, "cycle_time_ms": 2.0}
    replay = load_scenario(str(write(tmp_path, REPLAY + '[replay]\nforward_ms = 1\n', name="r.toml")))
    assert replay.replay_forward_ms == 1.0 and replay.replay_backward_ms == 250.0


BROKEN = [
    # (file text, text the message must contain after "<file>: ")
    ('modle = "vgg16"\n' + HEADER, "modle is not a known key"),
    (HEADER + "[data]\nbatchsize = 8\n", "[data].batchsize is not a known key; [data] takes image_size"),
    (HEADER + "[extra]\nx = 1\n", "extra is not a known key"),
    (HEADER + "[data.more]\nx = 1\n", "[data].more is not a known key"),
    (HEADER + "run = 3\n", "[run] must be a table, got 3"),
    (HEADER + '[data]\nbatch_size = "eight"\n', '[data].batch_size must be a positive integer, got "eight"'),
    (HEADER + "[run]\nnp = 2.0\n", "[run].np must be a positive integer, got 2.0"),
    (HEADER + "[run]\nnp = 0\n", "[run].np must be a positive integer, got 0"),
    (HEADER + "[tuning]\nmeasure_steps = true\n", "[tuning].measure_steps must be a positive integer, got true"),
    (HEADER + "[tuning]\nwarmup_steps = -1\n", "[tuning].warmup_steps must be a non-negative integer"),
    (HEADER + "[tuning]\ntime_budget_s = 0\n", "[tuning].time_budget_s must be a positive number"),
    (HEADER + "[tuning]\nblock_seconds = -1\n", "[tuning].block_seconds must be a positive number"),
    (REPLAY + '[replay]\nbackward_ms = "fast"\n', '[replay].backward_ms must be a non-negative number'),
    (REPLAY + "[replay]\nforward_ms = nan\n", "[replay].forward_ms must be a non-negative number"),
    # huge times once passed: the replay's int64 step counts wrapped and its backward pass never ran
    (REPLAY + "[replay]\nbackward_ms = 1e300\n", "[replay].backward_ms must be a non-negative number of milliseconds up to 3.6e+06"),
    (HEADER + "[tuning]\nblock_seconds = 1e308\n", "[tuning].block_seconds must be a positive number of seconds up to 604800"),
    (HEADER + "[replay]\nforward_ms = 5\n", '[replay] sets a replay\'s timings; this scenario trains resnet50 (workload = "train"): drop [replay]'),
    # sizes the models cannot take failed inside the ranks (torch's or Keras's own words, exit 1)
    (HEADER + "[data]\nimage_size = 16\n", "[data].image_size must be 32 to 1024 pixels for resnet50, got 16"),
    ('workload = "train"\nmodel = "vgg16"\n[data]\nimage_size = 100000\n', "[data].image_size must be 32 to 1024 pixels for vgg16"),
    (HEADER + '[knobs]\nfusion_threshold_bytes = "64 parsecs"\n', "[knobs].fusion_threshold_bytes must be a size in 0B .. 1GiB (bytes, or e.g. \"64MiB\"), got \"64 parsecs\""),
    (HEADER + '[knobs]\nsegment_bytes = "1KiB"\n', "[knobs].segment_bytes must be a size in 4KiB .. 256MiB"),
    (HEADER + "[knobs]\ncycle_time_ms = 5000\n", "[knobs].cycle_time_ms must be a number in 0.05 .. 1000, got 5000"),
    (HEADER + '[knobs]\nhierarchical = "maybe"\n', '[knobs].hierarchical must be true or false, got "maybe"'),
    (HEADER + "[knobs]\nfusion = 1\n", "[knobs].fusion is not a knob; knobs are fusion_threshold_bytes"),
    (HEADER + "knobs = 5\n", "[knobs] must be a table"),
    ('workload = "train"\nmodel = "alexnet"\n', 'model must be one of "resnet50", "vgg16", "bert", got "alexnet"'),
    (HEADER + 'framework = "jax"\n', 'framework must be one of "torch", "tensorflow", got "jax"'),
    ('workload = "infer"\nmodel = "bert"\n', 'workload must be one of "train", "replay"'),
    (HEADER + 'name = ""\n', 'name must be a non-empty string, got ""'),
    ('workload = "train"\n', "model is required"),
    (HEADER + "[run]\nnp = 2\nranks_per_node = 3\n", "[run].ranks_per_node must be at most [run].np = 2, got 3"),
    ('workload = "train"\nmodel = "bert"\n[data]\nseq_len = 1024\n', "[data].seq_len must be at most 512"),
    (HEADER + "[run]\nnp = 4\nlink_gbps = 10\n", "[run].link_gbps emulates the link between emulated nodes: set [run].ranks_per_node"),
    (HEADER + "[run]\nnp = 4\nranks_per_node = 2\nlink_gbps = 0\n", "[run].link_gbps must be a positive number of Gb/s, got 0"),
    (HEADER + '[run]\nnp = 4\nranks_per_node = 2\nlink_gbps = "fast"\n', '[run].link_gbps must be a positive number of Gb/s, got "fast"'),
    (HEADER + "[run]\nnp = 4\nranks_per_node = 2\nlink_gbps = 1e-9\n", "[run].link_gbps must be 0.001 .. 100000 Gb/s, got 1e-09"),
    (HEADER + "[run]\nnp = 4\nranks_per_node = 2\nlink_latency_us = 1e9\n", "[run].link_latency_us must be 0 .. 1e+06 us, got 1000000000.0"),
    (HEADER + "[lab]\nhosts = 2\nlink_gbps = 1e9\n", "[lab].link_gbps must be 0.001 .. 100000 Gb/s, got 1000000000.0"),
    (HEADER + "[run]\nlink_latency_us = -5\n", "[run].link_latency_us must be a non-negative number of microseconds"),
    (HEADER + "name = \n", "invalid TOML: "),
    (HEADER + '[data]\nbatch_size = 8\n[data]\nimage_size = 32\n', "invalid TOML: "),
    (HEADER + 'description = """two\nlines"""\n', "description is not a known key"),
]


@pytest.mark.parametrize(("text", "expected"), BROKEN, ids=[b[1][:40] for b in BROKEN])
def test_each_kind_of_broken_file_gives_one_line_naming_file_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    assert expected in message, message
    assert isinstance(info.value, TunelabError)


def test_a_file_nested_deeper_than_python_recurses_is_one_line(tmp_path):
    """Deeper than the recursion limit (1000 by default; TensorFlow's import raises it to 3000): the
    parser's RecursionError was a traceback."""
    import sys

    depth = sys.getrecursionlimit() + 10
    path = write(tmp_path, HEADER + "name = " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(ScenarioError, match=r"broken\.toml: invalid TOML: arrays or tables nested too deeply$"):
        load_scenario(path)


def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(ScenarioError, match=r"nope\.toml: no such scenario file$"):
        load_scenario(tmp_path / "nope.toml")
    with pytest.raises(ScenarioError, match=r"^no scenario named 'nosuch' \(nor a file of that name here\); shipped scenarios are .*resnet50"):
        load_scenario("nosuch")


def test_relative_paths_are_shown_relative(tmp_path, monkeypatch):
    write(tmp_path, HEADER + "[data]\nbatch_size = 0\n", name="rel.toml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScenarioError, match=r"^rel\.toml: \[data\]\.batch_size must be a positive integer"):
        load_scenario("./rel.toml")


def test_overrides_replace_given_values_and_merge_knobs():
    base = load_scenario("resnet50").with_overrides(knobs={"segment_bytes": "1MiB"})
    changed = base.with_overrides(batch_size=16, np=None, time_budget_s=60,
                                  knobs={"fusion_threshold_bytes": "8MiB"})
    assert (changed.batch_size, changed.np, changed.time_budget_s) == (16, 2, 60.0)
    assert changed.knobs == {"segment_bytes": MiB, "fusion_threshold_bytes": 8 * MiB}
    assert base.batch_size == 8 and base.knobs == {"segment_bytes": MiB}  # the original is untouched
    assert base.with_overrides() == base and base.with_overrides(model=None) == base
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.np = 3  # type: ignore[misc]


def test_invalid_overrides_are_refused_naming_the_key():
    s = load_scenario("resnet50")
    with pytest.raises(ScenarioError, match=r"resnet50\.toml with overrides: \[data\]\.batch_size must be a "
                                            r"positive integer, got 0$"):
        s.with_overrides(batch_size=0)
    with pytest.raises(ScenarioError, match=r"with overrides: \[knobs\]\.segment_bytes"):
        s.with_overrides(knobs={"segment_bytes": 1})
    with pytest.raises(ScenarioError, match="cannot override 'batchsize'"):
        s.with_overrides(batchsize=4)
    with pytest.raises(ScenarioError, match=r"with overrides: \[run\]\.ranks_per_node must be at most"):
        s.with_overrides(ranks_per_node=3)


def test_scenarios_built_in_code_are_validated_too():
    with pytest.raises(ScenarioError, match=r"^scenario 'x': model must be one of"):
        Scenario("x", "train", "lenet")
    assert Scenario("x", "replay", "vgg16", knobs={"segment_bytes": "64KiB"}).knobs == {"segment_bytes": 65536}


def test_lab_table_sets_hosts_and_default_ranks(tmp_path):
    s = load_scenario(write(tmp_path, HEADER + "[lab]\nhosts = 3\nlink_gbps = 10\nranks_per_host = 2\n"))
    assert (s.lab_hosts, s.lab_link_gbps, s.lab_ranks_per_host, s.np) == (3, 10.0, 2, 6)
    explicit = load_scenario(write(tmp_path, HEADER + "[run]\nnp = 3\n[lab]\nhosts = 3\nlink_gbps = 1\n", "b.toml"))
    assert explicit.np == 3 and explicit.lab_ranks_per_host == 1


@pytest.mark.parametrize("text, words", [
    ("[lab]\nhosts = 1\nlink_gbps = 1\n", "[lab].hosts must be an integer of at least 2, got 1"),
    ("[lab]\nhosts = 2\n", "[lab] needs both hosts and link_gbps"),
    ("[lab]\nhosts = 2\nlink_gbps = 0\n", "[lab].link_gbps must be a positive number"),
    ("[lab]\nhosts = 2\nlink_gbps = 1\nrack = 3\n", "[lab].rack is not a known key"),
    ("[run]\nnp = 3\n[lab]\nhosts = 2\nlink_gbps = 1\n", "does not spread evenly"),
    ("[run]\nnp = 4\nranks_per_node = 2\n[lab]\nhosts = 2\nlink_gbps = 1\n", "real hosts"),
])
def test_lab_table_errors_name_the_key(tmp_path, text, words):
    with pytest.raises(ScenarioError) as err:
        load_scenario(write(tmp_path, HEADER + text))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_file_in_the_working_directory_loads_whatever_its_extension(tmp_path, monkeypatch):
    shipped = load_scenario("resnet50")
    (tmp_path / "mine.txt").write_text(Path(shipped.path).read_text())
    monkeypatch.chdir(tmp_path)
    mine = load_scenario("mine.txt")  # a bare name that is no shipped scenario, but a file here
    assert mine.model == shipped.model and Path(mine.path).name == "mine.txt"
    assert load_scenario("resnet50").path == shipped.path  # a shipped name still means the shipped file


def test_a_scenario_saved_with_a_byte_order_mark_loads_as_without_one(tmp_path):
    """Some editors (Notepad, some IDEs on Windows) start a UTF-8 file with a byte order mark; TOML
    itself has none, so the mark is read past, not refused as an invalid statement."""
    text = scenario_path("resnet50").read_bytes()
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + text)
    plain = tmp_path / "plain.toml"
    plain.write_bytes(text)
    def fields(path):
        return dataclasses.replace(load_scenario(path), path=None, name="x")

    assert fields(marked) == fields(plain)
