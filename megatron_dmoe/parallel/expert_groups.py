"""The expert-parallel process groups an MoE layer uses, from megatron-core's parallel_state.

megatron-core carves, for TP = 1, the data-parallel ranks into expert-model-parallel groups (EP:
the ranks that exchange tokens and share out the experts) and expert-data-parallel groups (EDP:
ranks holding the same experts, which reduce their gradients). Megatron-LM users may instead pass
a ProcessGroupCollection with `ep` and `expt_dp` groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallelGroups:
    size: int
    rank: int
    group: Optional[object]  # the EP process group; None when size == 1
    data_parallel_group: Optional[object] = None  # the EDP group, when given explicitly

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


def expert_parallel_groups(size: int, pg_collection=None) -> ExpertParallelGroups:
    """The groups for expert_model_parallel_size = `size`; fails clearly when they do not exist."""
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        group = pg_collection.ep
        data_parallel = getattr(pg_collection, "expt_dp", None)
        if group.size() != size:
            raise ValueError(
                f"expert_model_parallel_size={size}, but the expert-parallel group passed in pg_collection "
                f"has {group.size()} ranks; make them agree."
            )
        return ExpertParallelGroups(size, group.rank(), group if size > 1 else None, data_parallel)
    if size == 1:
        return ExpertParallelGroups(1, 0, None)
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError(
            f"expert_model_parallel_size={size} needs torch.distributed and megatron-core's parallel_state "
            f"initialised with expert_model_parallel_size={size} before the MoE layer is built "
            "(megatron_dmoe.parallel.distributed.init_distributed does both)."
        )
    actual = ps.get_expert_model_parallel_world_size()
    if actual != size:
        raise RuntimeError(
            f"expert_model_parallel_size={size} in the TransformerConfig, but megatron-core's parallel_state "
            f"was initialised with expert_model_parallel_size={actual}; initialise both with the same size."
        )
    return ExpertParallelGroups(size, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group())
