"""Every YAML under configs/ loads, validates and survives a save/load round trip.

Files are collected from the folder, so configs added later are covered without editing this test.
Sweep definitions (any file under a folder named `sweeps`) are not run configs and are skipped.
Validation assumes a machine with CUDA, Transformer Engine and apex: a GPU config must be
consistent even when checked on a laptop.
"""
from pathlib import Path

import pytest

from megatron_dmoe.config import Environment, load_config, resolve, save_config, validate

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
RUN_CONFIGS = sorted(p for p in CONFIGS_DIR.rglob("*.yaml") if "sweeps" not in p.parts)


def test_the_default_configs_exist():
    names = {p.relative_to(CONFIGS_DIR).as_posix() for p in RUN_CONFIGS}
    assert {"base.yaml", "tiny.yaml"} <= names


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.relative_to(CONFIGS_DIR).as_posix())
def test_shipped_config_loads_and_validates(path, tmp_path):
    cfg = load_config(str(path))
    validate(cfg, env=Environment(cuda=True, transformer_engine=True, apex=True))
    assert load_config(str(save_config(cfg, tmp_path / "config.yaml", {}))) == resolve(cfg)


def test_shipped_names_resolve_to_the_repository_files():
    assert load_config("tiny") == load_config(str(CONFIGS_DIR / "tiny.yaml"))


def test_tiny_runs_on_this_machine():
    validate(load_config(None), world_size=1)  # probes this machine: no GPU needed
