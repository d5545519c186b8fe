"""load_config: shipped names, extends, overrides, unknown keys with did-you-mean, types."""
import dataclasses

import pytest

from megatron_dmoe.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    load as load_module,
    load_config,
)


def problems_of(call, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return info.value.problems


# --- finding the file ---------------------------------------------------------------------------

def test_none_tiny_and_tiny_yaml_are_the_shipped_default():
    default = load_config(None)
    assert load_config("tiny") == default == load_config("tiny.yaml")
    assert default.moe.num_experts > 0  # the default run is a dMoE model


def test_an_existing_file_wins_over_a_shipped_name(write, monkeypatch):
    path = write("tiny", "model:\n  num_layers: 7\n")
    monkeypatch.chdir(path.parent)
    assert load_config("tiny").model.num_layers == 7
    assert load_config(str(path)).model.num_layers == 7


def test_shipped_names_in_subfolders(tmp_path, monkeypatch):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "dmoe_small.yaml").write_text("extends: ../base.yaml\nmoe:\n  top_k: 3\n")
    (tmp_path / "base.yaml").write_text("moe:\n  num_experts: 16\n")
    monkeypatch.setattr(load_module, "shipped_configs_dir", lambda: tmp_path)
    for name in ("zoo/dmoe_small", "zoo/dmoe_small.yaml"):
        cfg = load_config(name)
        assert (cfg.moe.num_experts, cfg.moe.top_k) == (16, 3)


def test_missing_config_lists_the_shipped_ones():
    [(key, message)] = problems_of(load_config, "no_such_config_xyz")
    assert key == "no_such_config_xyz"
    assert "config not found" in message and "tiny" in message


def test_empty_file_gives_the_schema_defaults(write):
    assert load_config(str(write("empty.yaml", ""))) == RunConfig()


@pytest.mark.parametrize("text, fragment", [
    ("model:\n  num_layers: [1\n", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping of sections at the top level, got list"),
    ("model:\n  num_layers: 2\n  num_layers: 3\n", "'num_layers' appears twice"),
    ("model: 5\n", "expected a mapping of keys, got 5"),
])
def test_malformed_files_name_the_problem(write, text, fragment):
    path = write("bad.yaml", text)
    [(key, message)] = problems_of(load_config, str(path))
    assert fragment in message, message
    assert key in (str(path.resolve()), "model")


def test_yaml_scalars_read_as_in_yaml_1_2(write):
    path = write("c.yaml", "training:\n  lr: 3e-4\n  min_lr: 0\nlogging:\n  progress_bar: off\n"
                           "model:\n  num_layers: 010\n")
    cfg = load_config(str(path))
    assert cfg.training.lr == 3e-4 and isinstance(cfg.training.min_lr, float)
    assert cfg.logging.progress_bar == "off"
    assert cfg.model.num_layers == 10


# --- extends ------------------------------------------------------------------------------------

def test_extends_merges_nested_keys_and_replaces_lists(write):
    write("base.yaml", "model:\n  num_layers: 4\n  hidden_size: 256\n"
                       "data:\n  data_path: [0.5, a, 0.5, b]\n  split: '90,5,5'\n")
    child = write("child.yaml", "extends: base.yaml\nmodel:\n  num_layers: 6\n"
                                "data:\n  data_path: [c]\n")
    cfg = load_config(str(child))
    assert cfg.model.num_layers == 6           # the child wins
    assert cfg.model.hidden_size == 256        # a sibling key survives from the base
    assert cfg.data.data_path == ["c"]         # lists are replaced, not merged
    assert cfg.data.split == "90,5,5"


def test_extends_list_order_and_relative_paths(write):
    write("bases/a.yaml", "model:\n  num_layers: 1\n  hidden_size: 64\n")
    write("bases/b.yaml", "extends: a.yaml\nmodel:\n  num_layers: 2\n")  # relative to bases/
    write("bases/c.yaml", "model:\n  num_layers: 3\n  seq_length: 32\n")
    child = write("exp/run.yaml", "extends: [../bases/b.yaml, ../bases/c.yaml]\n"
                                  "training:\n  lr: 0.5\n")
    cfg = load_config(str(child))
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (3, 64, 32)
    assert cfg.training.lr == 0.5


def test_extends_a_shipped_config_by_name(write):
    cfg = load_config(str(write("mine.yaml", "extends: tiny\nmoe:\n  top_k: 1\n")))
    tiny = load_config("tiny")
    assert cfg.moe.top_k == 1
    assert dataclasses.replace(cfg.moe, top_k=tiny.moe.top_k) == tiny.moe
    assert cfg.training == tiny.training


def test_extends_cycle_names_the_files(write):
    a = write("a.yaml", "extends: b.yaml\n")
    write("b.yaml", "extends: a.yaml\n")
    [(key, message)] = problems_of(load_config, str(a))
    assert "extends cycle" in message
    assert "a.yaml -> " in message and "b.yaml -> " in message


def test_extends_self_is_a_cycle(write):
    a = write("a.yaml", "extends: a.yaml\n")
    [(_, message)] = problems_of(load_config, str(a))
    assert "extends cycle" in message


def test_a_base_reached_twice_is_not_a_cycle(write):
    write("root.yaml", "model:\n  num_layers: 5\n")
    write("left.yaml", "extends: root.yaml\n")
    write("right.yaml", "extends: root.yaml\n")
    child = write("child.yaml", "extends: [left.yaml, right.yaml]\n")
    assert load_config(str(child)).model.num_layers == 5


def test_missing_base_and_bad_extends_value(write):
    [(key, message)] = problems_of(load_config, str(write("c.yaml", "extends: nope.yaml\n")))
    assert key.endswith("c.yaml: extends") and "base config 'nope.yaml' not found" in message
    [(key, message)] = problems_of(load_config, str(write("d.yaml", "extends: {a: 1}\n")))
    assert "expected a path or a list of paths" in message


# --- overrides ----------------------------------------------------------------------------------

def test_overrides_apply_after_the_file_and_its_bases():
    cfg = load_config("tiny", ["moe.top_k=1", "data.data_path=[0.3,a,0.7,b]",
                               "moe.expert_capacity_factor=1.5", "training.lr=1e-3",
                               "data.split=98,2,0", "moe.top_k=3"])
    assert cfg.moe.top_k == 3  # the last override of a key wins
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert cfg.moe.expert_capacity_factor == 1.5
    assert cfg.training.lr == 1e-3
    assert cfg.data.split == "98,2,0"
    cleared = load_config("tiny", ["moe.expert_capacity_factor=2",
                                   "moe.expert_capacity_factor=null"])
    assert cleared.moe.expert_capacity_factor is None


def test_override_types_are_checked_and_all_reported():
    problems = problems_of(load_config, "tiny", [
        "model.num_layers=two", "training.bf16=1", "training.fp16=yes", "model.hidden_size=null",
        "model.seq_length=64.0", "moe.topk=2", "modle.num_layers=3"])
    assert problems == [
        ("model.num_layers", "expected an integer, got 'two'"),
        ("model.hidden_size", "expected an integer, got null"),
        ("model.seq_length", "expected an integer, got 64.0 (write 64)"),
        ("moe.topk", "unknown key; did you mean moe.top_k?"),
        ("training.bf16", "expected true or false, got 1"),
        ("training.fp16", "expected true or false, got 'yes'"),
        ("modle", "unknown section; did you mean model?"),
    ]


@pytest.mark.parametrize("override", ["moe.top_k", "top_k=2", "a.b.c=1", ".x=1", "=3"])
def test_malformed_overrides(override):
    [(key, message)] = problems_of(load_config, "tiny", [override])
    assert key == override and "section.key=value" in message


def test_override_value_that_is_not_yaml():
    [(key, message)] = problems_of(load_config, "tiny", ["data.data_path=[a, b"])
    assert key == "data.data_path" and "cannot read the value" in message


def test_int_overrides_for_floats_become_floats():
    cfg = load_config("tiny", ["training.lr=1", "training.min_lr=0"])
    assert cfg.training.lr == 1.0 and type(cfg.training.lr) is float
    assert type(cfg.training.min_lr) is float


# --- unknown keys and types in files ------------------------------------------------------------

def test_every_structural_problem_of_a_file_at_once(write):
    path = write("c.yaml", "model:\n  hiden_size: 64\n  num_layers: two\n"
                           "mooe:\n  top_k: 2\n"
                           "training:\n  bf16: 'true'\n  num_experts: 4\n"
                           "hidden_size: 12\n")
    problems = problems_of(load_config, str(path))
    assert problems == [
        ("model.hiden_size", "unknown key; did you mean model.hidden_size?"),
        ("model.num_layers", "expected an integer, got 'two'"),
        ("training.bf16", "expected true or false, got 'true'"),
        ("training.num_experts", "unknown key in section 'training'; it belongs to "
                                 "moe.num_experts"),
        ("mooe", "unknown section; did you mean moe?"),
        ("hidden_size", "unknown section; a key of this name belongs in a section: "
                        "model.hidden_size"),
    ]


def test_unknown_key_without_a_close_match_lists_the_section():
    [(key, message)] = problems_of(config_from_dict, {"parallel": {"zzz": 1}})
    assert key == "parallel.zzz"
    assert "tensor_model_parallel_size" in message and "sequence_parallel" in message


def test_config_from_dict_round_trip_and_defaults():
    cfg = load_config("tiny")
    as_dict = config_to_dict(cfg)
    assert list(as_dict) == ["model", "moe", "parallel", "training", "data", "checkpoint",
                             "logging"]
    assert config_from_dict(as_dict) == cfg
    as_dict["data"]["data_path"].append("x")  # a copy: changing it leaves cfg alone
    assert cfg.data.data_path == []
    assert config_from_dict({}) == RunConfig()
    assert config_from_dict({"moe": None, "versions": {"torch": "x"}}) == RunConfig()


def test_config_from_dict_rejects_extends():
    [(key, message)] = problems_of(config_from_dict, {"extends": "tiny"})
    assert key == "extends" and "load_config" in message


def test_a_single_string_is_a_one_prefix_data_path():
    assert config_from_dict({"data": {"data_path": "/d/x"}}).data.data_path == ["/d/x"]
