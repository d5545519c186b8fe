"""The layer builds the way megatron-core builds an MLP submodule from a ModuleSpec."""
import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_dmoe.moe import MoELayer
from megatron_dmoe.parallel.param_roles import is_expert_parallel
from moe_reference import make_config


def test_build_module_passes_spec_params_as_options():
    config = make_config(16, 24, 4, 2, activation="swiglu")
    spec = ModuleSpec(module=MoELayer, params={"backend": "reference", "memory_optimized": True})
    layer = build_module(spec, config=config)
    assert isinstance(layer, MoELayer)
    assert layer.options.backend == "reference" and layer.options.memory_optimized
    layer.set_layer_number(3)
    assert layer.layer_number == 3
    out, bias = layer(torch.randn(4, 2, 16, dtype=torch.float64), padding_mask=None)
    assert out.shape == (4, 2, 16) and bias is None


def test_expert_parameters_are_marked_for_expert_data_parallel_reduction():
    layer = MoELayer(make_config(16, 24, 4, 2, activation="swiglu"))
    experts = dict(layer.experts.named_parameters())
    assert sorted(experts) == ["v1", "w1", "w2"]
    # reduced over the expert-data-parallel group (the data-parallel group at EP = 1), as at any EP size
    assert all(is_expert_parallel(p) and p.shape == (4, 24, 16) for p in experts.values())
    assert not is_expert_parallel(layer.router.weight)
    assert layer.router.weight.shape == (4, 16)
    std = torch.cat([p.flatten() for p in experts.values()]).std().item()
    assert abs(std - 0.02) < 0.002  # megatron's default init_method_std
