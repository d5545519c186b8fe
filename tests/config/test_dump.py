"""save_config / config_to_yaml: what is written loads back to the same RunConfig."""
import random
import string

import pytest

from megatron_dmoe.config import RunConfig, config_to_yaml, load_config, resolve, save_config, software_versions
from megatron_dmoe.config.fields import section_types


def test_tiny_round_trip_through_a_run_directory(tmp_path):
    cfg = load_config("tiny", ["moe.top_k=1", "data.data_path=[0.3,a,0.7,b]"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml", {"torch": "9.9", "python": "3.x"})
    again = load_config(str(path))
    assert again == resolve(cfg)
    assert again.moe.router_renormalize is False and again.model.ffn_hidden_size == 512
    assert again.derived == resolve(cfg).derived and "training.lr_decay_iters" in again.derived
    assert save_config(again, tmp_path / "second.yaml", {}).read_text() == \
        config_to_yaml(again, {"versions": {}, "derived": list(again.derived)})
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.yaml"]  # no temp file left


def test_versions_block_is_written_and_ignored_on_load(tmp_path):
    path = save_config(RunConfig(), tmp_path / "c.yaml")
    text = path.read_text()
    assert text.index("versions:") < text.index("model:")
    versions = software_versions()
    assert {"python", "torch", "megatron-core", "megatron_dmoe"} <= set(versions)
    for name, version in versions.items():
        assert f"  {name}: {version}" in text
    assert load_config(str(path)) == resolve(RunConfig())


def test_header_must_not_replace_sections():
    with pytest.raises(ValueError, match="model"):
        config_to_yaml(RunConfig(), {"model": {}})


TRICKY_STRINGS = ["off", "on", "yes", "no", "null", "~", "true", "1e-3", "010", "0x10", "1_000",
                  "2024-01-01", "12:30", "", " lead", "a: b", "- x", "#c", "[1]", "*a", "9.0",
                  ".inf", "üñí", "multi\nline"]


def _random_value(rng, annotation):
    name = repr(annotation)
    if "List" in name:
        return [_random_string(rng) for _ in range(rng.randint(0, 4))]
    if "Optional" in name and rng.random() < 0.3:
        return None
    if "bool" in name:
        return rng.random() < 0.5
    if "int" in name:
        return rng.randint(-10**12, 10**12)
    if "float" in name:
        return rng.choice([rng.uniform(-1e6, 1e6), rng.random() * 10 ** rng.randint(-300, 300),
                           0.1, 1e-8, -0.0, 2.0 ** 16])
    return _random_string(rng)


def _random_string(rng):
    if rng.random() < 0.5:
        return rng.choice(TRICKY_STRINGS)
    return "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 12)))


@pytest.mark.parametrize("seed", range(20))
def test_random_configs_round_trip_exactly(tmp_path, seed):
    """Any well-typed value (validity aside) survives the YAML text, floats bit for bit."""
    rng = random.Random(seed)
    cfg = RunConfig()
    for section, types in section_types().items():
        for name, annotation in types.items():
            setattr(getattr(cfg, section), name, _random_value(rng, annotation))
    path = tmp_path / "c.yaml"
    path.write_text(config_to_yaml(cfg, {"versions": {"x": "1"}}), encoding="utf-8")
    assert load_config(str(path)) == cfg
