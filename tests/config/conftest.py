"""Fixtures for the config tests: the shipped tiny config and a way to change keys of a copy."""
import copy

import pytest

from megatron_dmoe.config import load_config


@pytest.fixture(scope="session")
def tiny_config():
    return load_config("tiny")


@pytest.fixture
def make(tiny_config):
    """make({"moe.top_k": 9}) -> a copy of tiny with those keys set as given (no type checks)."""
    def _make(changes=None):
        cfg = copy.deepcopy(tiny_config)
        for key, value in (changes or {}).items():
            section, name = key.split(".")
            assert hasattr(getattr(cfg, section), name), key
            setattr(getattr(cfg, section), name, value)
        return cfg
    return _make


@pytest.fixture
def write(tmp_path):
    """write("a.yaml", text) -> path of a file created under a fresh temporary folder."""
    def _write(name, text):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path
    return _write
