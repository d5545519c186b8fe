"""Our model's weights, read out of megatron-core's modules, in the shapes transformers' layers use (and back)."""
from __future__ import annotations

from typing import Dict, Tuple

import torch


def model_state(model) -> Dict[str, torch.Tensor]:
    """Parameters and buffers of the unwrapped GPTModel by name, detached on the CPU (no _extra_state)."""
    from megatron.core.utils import unwrap_model

    state = unwrap_model(model).state_dict()
    return {k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def split_qkv(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> Tuple[torch.Tensor, ...]:
    """megatron-core's linear_qkv weight [(q, k, v) rows, in] or bias -> q, k, v.

    Its rows come per query group: that group's heads' queries, then its key, then its value
    ([groups, heads/groups + 2, head_dim]), not all queries, all keys, all values.
    """
    per_group = num_heads // num_groups
    rest = fused.shape[1:]
    grouped = fused.reshape(num_groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(num_heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(num_groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(num_groups * head_dim, *rest)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
             head_dim: int) -> torch.Tensor:
    """q [heads * head_dim, ...], k and v [groups * head_dim, ...] -> megatron-core's linear_qkv
    rows (the inverse of split_qkv)."""
    per_group = num_heads // num_groups
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(num_groups, per_group, head_dim, *rest),
                         k.reshape(num_groups, 1, head_dim, *rest),
                         v.reshape(num_groups, 1, head_dim, *rest)], dim=1)
    return grouped.reshape(num_groups * (per_group + 2) * head_dim, *rest)
