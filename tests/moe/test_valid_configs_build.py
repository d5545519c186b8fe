"""One source of truth for MoE rules: every combination of MoE settings that validation accepts
builds the layer (through the same TransformerConfig and spec params as training) and runs forward
and backward on CPU; every one it refuses is refused with MoE keys named, before anything is built."""
import itertools
import os

import pytest
import torch

from megatron_dmoe.config import ConfigError, Environment, find_problems, resolve
from megatron_dmoe.config.moe_settings import OPTION_KEYS
from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.model.gpt import moe_layer_params
from megatron_dmoe.model.transformer_config import to_transformer_config
from megatron_dmoe.moe import MoELayer

CPU = Environment(cuda=False, transformer_engine=False, apex=False)
SETTING_KEYS = set(OPTION_KEYS.values()) | {"moe.expert_wgrad_per_step", "moe.expert_wgrad_window"}

ROUTER_GRID = {  # reference experts: every router and dispatch setting together
    "moe.router_score_function": ["softmax", "sigmoid"],
    "moe.router_pre_softmax": [True, False],
    "moe.router_enable_expert_bias": [False, True],
    "moe.top_k": [1, 2, 4],
    "moe.router_renormalize": [None, True, False],
    "moe.expert_capacity_factor": [None, 1.0],
}
EXPERT_GRID = {  # every expert backend setting together, with one router
    "moe.backend": ["auto", "reference", "grouped", "sparse"],
    "moe.block_size": [16, 64, 128, 100],
    "model.activation": ["gelu", "swiglu"],
    "moe.memory_optimized": [False, True],
    "moe.expert_capacity_factor": [None, 1.5],
}


def _config(settings: dict) -> RunConfig:
    cfg = RunConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 1, 16, 2
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.ffn_hidden_size = 4, 2, 64
    cfg.moe.z_loss_coeff = 0.01
    cfg.training.device = "cpu"
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _combinations(grid):
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*grid.values())]


def _build_and_run(cfg: RunConfig) -> None:
    cfg = resolve(cfg)
    config = to_transformer_config(cfg, on_cuda=False)
    layer = MoELayer(config, **moe_layer_params(cfg))
    layer.set_layer_number(1)
    layer.train()
    x = torch.randn(6, 2, cfg.model.hidden_size, requires_grad=True)
    out, _ = layer(x)
    out.square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.router.weight.grad).all()
    if cfg.moe.router_enable_expert_bias:
        layer.update_expert_bias()


def _check(settings: dict) -> bool:
    """True when the combination validated (and then built and ran), False when it was refused."""
    cfg = _config(settings)
    problems = find_problems(cfg, 1, env=CPU)
    if problems:
        assert {key for key, _ in problems} <= SETTING_KEYS, problems  # the MoE keys are named
        with pytest.raises(ConfigError):  # and validate() refuses it the same way
            from megatron_dmoe.config import validate

            validate(cfg, 1, env=CPU)
        return False
    _build_and_run(cfg)
    return True


@pytest.fixture(autouse=True)
def _one_process(cpu_dist):
    yield


def _router_refused(s: dict) -> bool:
    """The router rules, written out: the expert bias needs sigmoid scores; top-1 softmax after
    selection is refused; so is renormalising a top-1 weight."""
    softmax, top1 = s["moe.router_score_function"] == "softmax", s["moe.top_k"] == 1
    return ((softmax and s["moe.router_enable_expert_bias"]) or (softmax and top1 and not s["moe.router_pre_softmax"])
            or (top1 and s["moe.router_renormalize"] is True))


def _expert_refused(s: dict) -> bool:
    """A block size that is no power of two is refused; on CPU the sparse backend runs only under
    Triton's interpreter (tests/conftest.py turns it on without CUDA), and its blocks must divide
    the expert FFN (64)."""
    if s["moe.block_size"] == 100:
        return True
    sparse_on_cpu = os.environ.get("TRITON_INTERPRET") == "1"
    return s["moe.backend"] == "sparse" and (not sparse_on_cpu or s["moe.block_size"] > 64)


@pytest.mark.slow
def test_every_valid_router_combination_builds_and_runs():
    combos = _combinations(ROUTER_GRID)
    accepted = [settings for settings in combos if _check(settings)]
    # exactly the combinations the rules allow ran; the refused ones named their keys
    assert accepted == [settings for settings in combos if not _router_refused(settings)]
    assert len(accepted) == 92


@pytest.mark.slow
def test_every_valid_expert_backend_combination_builds_and_runs():
    combos = _combinations(EXPERT_GRID)
    accepted = [settings for settings in combos if _check(settings)]
    assert accepted == [settings for settings in combos if not _expert_refused(settings)]
    assert len(accepted) == (88 if os.environ.get("TRITON_INTERPRET") == "1" else 72)


def test_the_previously_late_failure_is_refused_with_its_key():
    """router_enable_expert_bias with the default softmax router used to pass validation and die in
    megatron's TransformerConfig after data preparation."""
    problems = find_problems(_config({"moe.router_enable_expert_bias": True}), 1, env=CPU)
    assert [key for key, _ in problems] == ["moe.router_enable_expert_bias"]
