"""The tensor-parallel group whose ranks hold different sequence shards (sequence parallelism).

Under megatron's sequence parallelism the tensors between the parallel linears are split along the
sequence over the tensor-parallel ranks: a module replicated over them (norms, the MoE router,
shared experts) sees only its rank's tokens. Its parameters' gradients are then summed over the
group (megatron's `sequence_parallel` attribute and finalize_model_grads), and statistics that
need every token of a sequence (expert loads for the aux losses) are summed over it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceShards:
    size: int  # ranks the sequence is split over (1: every rank sees whole sequences)
    group: Optional[object] = None  # their process group; None when size == 1

    @torch.no_grad()
    def total(self, local: torch.Tensor) -> torch.Tensor:
        """`local` summed over the shards (a new tensor; `local` itself when there is one shard)."""
        if self.group is None:
            return local
        out = local.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def sequence_shards(config, pg_collection=None) -> SequenceShards:
    """The shards a module built from this TransformerConfig sees (1 without sequence parallelism)."""
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if not getattr(config, "sequence_parallel", False) or tp == 1:
        return SequenceShards(1)
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    return SequenceShards(tp, group)
