"""A run without data: its config names a tokenizer but no data.data_path (dmoe-import run without
data). Elsewhere an empty data.data_path means the built-in corpus, whose tokenizer is its own, so
validation and the tokenizer builder refuse a tokenizer without data; inference, which reads no
training data, checks and builds such a run here instead.
"""
from __future__ import annotations

import copy

from megatron_dmoe.config import RunConfig, validate

# validation's stand-in for the data a run without data has not got (never read)
_STAND_IN = "no-data-yet"


def has_no_data(cfg: RunConfig) -> bool:
    """A tokenizer of its own (data.tokenizer_type or data.tokenizer_model) and no data.data_path."""
    data = cfg.data
    return not data.data_path and bool(data.tokenizer_type or data.tokenizer_model)


def validate_without_data(cfg: RunConfig, world_size: int) -> None:
    """validate(), the data paths aside (ConfigError as validate raises it)."""
    if has_no_data(cfg):
        cfg = copy.deepcopy(cfg)
        cfg.data.data_path = [_STAND_IN]
    validate(cfg, world_size=world_size)


def build_run_tokenizer(cfg: RunConfig):
    """The run's tokenizer (data.build_tokenizer, also for a run without data); raises DataError."""
    from megatron_dmoe.data import build_tokenizer
    from megatron_dmoe.data.megatron_tokenizers import spec_from_data_config

    if has_no_data(cfg):
        return spec_from_data_config(cfg.data).build()
    return build_tokenizer(cfg)
