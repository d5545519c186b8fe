"""The final norm of a transformer block built from a layer spec: ours where it would be torch's.

megatron-core (0.16 through 0.19, checked: 0.16.1, 0.19.1) gives a TransformerBlock built from a
layer ModuleSpec (what Megatron-LM's `pretrain_gpt.py --spec MODULE NAME` hands it) the final norm
`transformer_block.LayerNormImpl`: Transformer Engine's or apex's where one is installed, else
`WrappedTorchNorm`, which refuses sequence parallelism when it is built. The layers of our spec
already put `FusedNorm` in those slots (model/spec.py); this gives the block's final norm the same,
so that Megatron-LM runs our spec at tensor parallelism with `--sequence-parallel`. Our own
training builds its blocks with their final norm named (model/spec.py's block_spec) and never
reads it. Could go once upstream's torch fallback norm takes sequence parallelism (marking its
parameters as such) or a layer spec can name its block's final norm.
"""
from __future__ import annotations


def use_for_block_final_norm(norm_class) -> None:
    """From now on, blocks built from a layer spec take `norm_class` as their final norm wherever
    megatron-core would take torch's (no Transformer Engine, no apex); elsewhere nothing changes."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if transformer_block.LayerNormImpl is WrappedTorchNorm:
        transformer_block.LayerNormImpl = norm_class
