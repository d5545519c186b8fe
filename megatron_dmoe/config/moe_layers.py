"""Which layers of a run carry an MoE MLP: one rule for the model, the FLOP count and validation."""
from __future__ import annotations

from typing import List, Union


def moe_layer_pattern(num_layers: int, layer_freq: int, first_dense_layers: int = 0) -> List[bool]:
    """Layer i (0-based) is an MoE layer when i % layer_freq == 0 and i >= first_dense_layers.

    first_dense_layers replaces the first MoE layers by dense ones, as DeepSeek-V2/V3's
    first_k_dense_replace does (every layer from it on is MoE with layer_freq 1).
    """
    return [i % layer_freq == 0 and i >= first_dense_layers for i in range(num_layers)]


def megatron_moe_layer_freq(num_layers: int, layer_freq: int, first_dense_layers: int = 0) -> Union[int, List[int]]:
    """The same pattern as megatron-core's TransformerConfig.moe_layer_freq: the integer when no
    layer is replaced, else one 0/1 entry per layer (Megatron-LM's --moe-layer-freq "([0]*3+[1]*9)")."""
    if not first_dense_layers:
        return layer_freq
    return [int(moe) for moe in moe_layer_pattern(num_layers, layer_freq, first_dense_layers)]
