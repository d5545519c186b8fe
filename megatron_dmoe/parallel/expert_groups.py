"""The expert-parallel process groups an MoE layer uses, from megatron-core's parallel_state.

megatron-core carves the ranks of a pipeline stage into expert-tensor-parallel groups (ETP: ranks
holding different ffn shards of the same experts), expert-model-parallel groups (EP: ranks holding
different experts) and expert-data-parallel groups (EDP: ranks holding the same shards, which
reduce their gradients). The MoE layer exchanges tokens over EP x ETP ranks (megatron's expert
tensor-and-model-parallel group): whole experts over EP, and every shard of an expert gets the
expert's tokens (parallel/expert_layout.py). Megatron-LM users may instead pass a
ProcessGroupCollection with `ep` (and with ETP > 1 `tp_ep`) and `expt_dp` groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallelGroups:
    size: int  # ranks of the exchange: EP x ETP
    rank: int  # this rank among them (ep_rank * ETP + etp_rank)
    group: Optional[object]  # their process group; None when size == 1
    data_parallel_group: Optional[object] = None  # the EDP group, when given explicitly
    tensor_size: int = 1  # ETP: ranks each expert's FFN is split over by choice

    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks holding the same experts (0 without process groups).

        Read when asked (checkpoints), not at build time: megatron's groups may be rebuilt in between.
        """
        if self.data_parallel_group is not None:
            return dist.get_rank(self.data_parallel_group)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_expert_data_parallel_rank()
        return 0


def expert_parallel_groups(size: int, pg_collection=None, tensor_size: int = 1) -> ExpertParallelGroups:
    """The groups for expert_model_parallel_size = `size` and expert_tensor_parallel_size =
    `tensor_size`; fails clearly when they do not exist."""
    ranks = size * tensor_size
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        group = pg_collection.ep if tensor_size == 1 else getattr(pg_collection, "tp_ep", None)
        if group is None:
            raise ValueError(f"expert_tensor_parallel_size={tensor_size} needs the expert tensor-and-model-parallel "
                             "group in pg_collection (`tp_ep`); pass it.")
        data_parallel = getattr(pg_collection, "expt_dp", None)
        if group.size() != ranks:
            raise ValueError(
                f"expert_model_parallel_size={size} x expert_tensor_parallel_size={tensor_size}, but the expert-"
                f"parallel group passed in pg_collection has {group.size()} ranks; make them agree."
            )
        return ExpertParallelGroups(ranks, group.rank(), group if ranks > 1 else None, data_parallel, tensor_size)
    if ranks == 1:
        return ExpertParallelGroups(1, 0, None)
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError(
            f"expert_model_parallel_size={size} x expert_tensor_parallel_size={tensor_size} needs "
            "torch.distributed and megatron-core's parallel_state initialised with the same sizes before the "
            "MoE layer is built (megatron_dmoe.parallel.distributed.init_distributed does both)."
        )
    actual = (ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    if actual != (size, tensor_size):
        raise RuntimeError(
            f"expert_model_parallel_size={size}, expert_tensor_parallel_size={tensor_size} in the TransformerConfig, "
            f"but megatron-core's parallel_state was initialised with {actual[0]} and {actual[1]}; initialise both "
            "with the same sizes."
        )
    if tensor_size == 1:
        return ExpertParallelGroups(size, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group())
    group = ps.get_expert_tensor_and_model_parallel_group()
    rank = dist.get_rank(group)
    # the layout's rule: the expert-tensor rank varies fastest within the exchange group
    expected = ps.get_expert_model_parallel_rank() * tensor_size + ps.get_expert_tensor_parallel_rank()
    if rank != expected:
        raise RuntimeError(f"megatron-core's expert tensor-and-model-parallel group puts this rank at {rank}, not at "
                           f"expert-parallel rank x {tensor_size} + expert-tensor rank = {expected}.")
    return ExpertParallelGroups(ranks, rank, group, None, tensor_size)
