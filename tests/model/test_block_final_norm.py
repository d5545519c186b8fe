"""A block megatron-core builds from our layer spec (Megatron-LM's --spec) ends in a norm that takes
sequence parallelism: torch's fallback norm refuses it at build time."""
import pytest
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import _get_block_submodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dmoe.model.norm import FusedNorm
from megatron_dmoe.model.spec import dmoe_layer_spec


def _sequence_parallel_config():
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                             moe_router_topk=2, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                             sequence_parallel=True)


def test_the_final_norm_of_a_block_from_the_layer_spec_takes_sequence_parallelism(cpu_dist):
    config = _sequence_parallel_config()
    submodules = _get_block_submodules(config, dmoe_layer_spec)
    assert len(submodules.layer_specs) == 2 and submodules.layer_norm is FusedNorm
    norm = build_module(submodules.layer_norm, config=config, hidden_size=64, eps=1e-5)
    assert norm.weight.sequence_parallel  # its gradient is summed over the tensor-parallel ranks
    with pytest.raises(AssertionError):  # what megatron-core's fallback would have done
        build_module(WrappedTorchNorm, config=config, hidden_size=64, eps=1e-5)
