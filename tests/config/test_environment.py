"""Environment probes: what validation believes about the machine."""
import importlib
import sys

import torch

from megatron_dmoe.config import Environment
from megatron_dmoe.config.environment import apex_available, transformer_engine_available


def test_detect_matches_torch():
    assert Environment.detect().cuda == torch.cuda.is_available()


def _forget(*names):
    for name in names:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def test_unrelated_apex_package_does_not_count(tmp_path, monkeypatch):
    """The registry's `apex` is another project: only NVIDIA's (with apex.normalization) counts."""
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        _forget("apex", "apex.normalization")
        assert not apex_available()
        (tmp_path / "apex" / "normalization").mkdir()
        (tmp_path / "apex" / "normalization" / "__init__.py").write_text("")
        _forget("apex", "apex.normalization")
        assert apex_available()
        assert transformer_engine_available()
    finally:
        _forget("apex", "apex.normalization", "transformer_engine")
