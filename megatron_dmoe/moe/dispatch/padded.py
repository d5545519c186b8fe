"""Dispatch for the block-sparse experts: tokens go straight into the expert-grouped, block-padded
buffer that the `sparse` backend computes on, and come back weighted, by two fused kernels.

plan: count the routed copies per expert, build the dMoE topology from the counts on the device
and find each copy's padded row (a counting sort by expert), all on the device. The path then hands
the tokens to `padded_experts_combine`: the permutation (one kernel writes every copy to its row
and zeroes the padding rows), the experts and the weighted combine in one autograd function (one
kernel sums each token's weighted copies; backward gets the router-weight gradient without keeping
the expert output, and sums dx back in the same launch). Every buffer is sized by the bound
T*k + E*(block-1) rows: no count comes back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..experts.sparse import block_size_for, sparse_experts_combine
from ..options import BLOCK_SIZES


@dataclass
class PaddedState:
    topology: object  # dmoe_kernels.Topology of the [padded rows x E*ffn] hidden activation
    positions: torch.Tensor  # [T, k] int32: padded row of copy (t, j)
    counts: torch.Tensor  # [E] int64: routed copies per expert, padding tokens included
    weights: torch.Tensor  # [T, k]


class PaddedDispatcher:
    """plan -> PaddedState: where each routed copy goes in the padded buffer; the permutation itself
    runs inside `padded_experts_combine`.

    block_size: the preferred block size. With strict=True (backend='sparse' chosen by name) it
    must divide ffn_hidden_size; otherwise the largest supported size that divides it is used.
    """

    def __init__(self, num_experts: int, ffn_hidden_size: int, block_size: int = 128, strict: bool = False):
        if strict and (block_size not in BLOCK_SIZES or ffn_hidden_size % block_size):
            raise ValueError(
                f"MoE option 'block_size'={block_size} with ffn_hidden_size={ffn_hidden_size}: the sparse "
                f"backend needs a block size in {BLOCK_SIZES} that divides the expert width; change "
                "block_size or ffn_hidden_size, or use backend='grouped'."
            )
        self.num_experts = num_experts
        self.ffn_hidden_size = ffn_hidden_size
        self.block_size = block_size_for(ffn_hidden_size, block_size)

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> PaddedState:
        """Where each routed copy goes (topology, positions, counts), on the device."""
        import dmoe_kernels as dk
        from dmoe_kernels.permutation.ops import expert_histogram, positions_from_histogram

        if self.block_size is None:
            raise ValueError(
                f"ffn_hidden_size={self.ffn_hidden_size} is not a multiple of {min(BLOCK_SIZES)}, the smallest "
                "block size of the sparse backend; use backend='grouped' or 'reference'."
            )
        num_tokens, top_k = indices.shape
        # the positions kernels' cumulative histogram also gives the counts (its last column)
        cumulative = expert_histogram(indices, self.num_experts)
        counts = cumulative[:, -1].to(torch.int64)
        topo = dk.Topology.for_experts(counts, num_tokens * top_k, self.ffn_hidden_size, self.block_size)
        positions = positions_from_histogram(indices, cumulative, topo.expert_offsets)
        return PaddedState(topo, positions, counts, weights)


def padded_experts_combine(experts, x: torch.Tensor, state: PaddedState, aux_loss=None) -> torch.Tensor:
    """y [T, h] from the tokens x [T, h] and a `plan`: the permutation into the padded buffer, the
    expert MLPs of an `ExpertMLP` on it (block-sparse kernels) and the weighted combine, in one
    autograd function that needs no saved expert output. aux_loss: the layer's aux losses, which get
    their gradient there."""
    opts = experts.options
    return sparse_experts_combine(
        x, experts.w1, experts.v1, experts.w2, state.weights, state.topology, state.positions, state.counts,
        opts.activation, opts.memory_optimized, experts.wgrad_stash, aux_loss=aux_loss, fp8=opts.fp8,
    )
