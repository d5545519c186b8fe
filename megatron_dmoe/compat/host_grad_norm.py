"""megatron-core's gradient norm on the host, accumulated in float64.

Without Transformer Engine or apex, megatron-core (0.16 through 0.19) computes the norm its
optimizers clip by with `utils.local_multi_tensor_l2_norm`: `torch.norm` of each fp32 gradient.
torch's CPU norm kernel accumulates the squares in fp32 without the pairwise summation of
`torch.sum`: once a running sum has grown, the squares of small gradient elements fall below its
last bit and are lost, so the norm comes out low, never high. An embedding gradient (most rows small: tokens absent
from the batch, or seen rarely) loses 4e-5 of its norm this way, and the distributed optimizer
reported a norm 1e-5 below the one megatron_dmoe's own CPU optimizer computes in float64 from the
same gradients. CUDA's reduction sums in a tree and is not affected.

`use_float64_host_grad_norm()` makes megatron's clipping code compute each tensor's norm in float64
on the host. Upstream, `local_multi_tensor_l2_norm` would have to accumulate in float64 (or sum
the squares pairwise, as `torch.sum` does) for this module to be dropped.
"""
from __future__ import annotations

from typing import List

import torch


def float64_l2_norm(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor, *args):
    """apex's multi_tensor_l2norm signature: (the L2 norm of all tensors of the lists as one vector,
    shape [1] fp32; None). Each tensor's sum of squares is accumulated in float64."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for tensors in tensor_lists for t in tensors]
    if not norms:
        return torch.zeros(1, dtype=torch.float32), None
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def use_float64_host_grad_norm() -> None:
    """Make megatron-core's optimizers (run on the host) compute their gradient norm as above."""
    from megatron.core.optimizer import clip_grads

    clip_grads.l2_norm_impl = float64_l2_norm
