"""torch's multi-tensor (foreach) kernels where megatron-core falls back to per-tensor loops.

Without apex or Transformer Engine, megatron-core (0.16 through 0.19, checked: 0.16.1, 0.19.1)
replaces apex's multi_tensor_scale and multi_tensor_l2norm by loops (`utils.local_multi_tensor_*`):
it copies the fp32 master weights into the bf16 model as `dst.copy_(src * 1.0)` per tensor (an
fp32 temporary the size of each weight: 14 bytes of traffic per parameter instead of 6) and
computes the gradient norm with one host synchronisation per tensor. `use_foreach_multi_tensor_ops`
puts torch's foreach kernels in their place, in apex's call signatures: a few launches, without
temporaries or synchronisation. Could go once upstream's fallbacks use torch's foreach ops.
"""
from __future__ import annotations

from typing import List

import torch


# torch's foreach kernels in apex's call signatures, as megatron calls them through its
# `multi_tensor_applier(op, noop_flag, tensor_lists, *args)`.
def foreach_l2_norm(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor, *args):
    """(norm of all tensors of tensor_lists[0] as one vector, shape [1] fp32; None)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], scale) -> None:
    """tensor_lists[1][i] = tensor_lists[0][i] * scale (in place when both lists are the same tensors)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif not isinstance(scale, torch.Tensor) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> None:
    """Swap them in wherever megatron-core fell back to its loops (neither apex nor TE present)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
