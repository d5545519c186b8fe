"""Roles of parameters: the attributes on a torch Parameter that megatron-core or this package read.

megatron-core tells parameters apart by attributes set on them (`allreduce`, `main_grad`,
`grad_added_to_main_grad`, ...); their names stay as megatron-core spells them because its code
reads them. Every place in this package that sets or reads such an attribute goes through the
helpers here, so each role has one spelling and one default.
"""
from __future__ import annotations

from typing import Optional

import torch


def mark_expert_parallel(param: torch.Tensor) -> None:
    """`allreduce = False`: megatron-core's DDP reduces it over the expert-data-parallel group only."""
    param.allreduce = False


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Marked by mark_expert_parallel; read by our optimizer groups, grad norm and parameter counts."""
    return not getattr(param, "allreduce", True)


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """megatron-core's `sequence_parallel`: a parameter replicated over the tensor-parallel ranks
    that each see only their sequence shard; finalize_model_grads sums its gradient over them."""
    param.sequence_parallel = True


def mark_tensor_parallel(param: torch.Tensor, dim: int) -> None:
    """megatron-core's `tensor_model_parallel` (with its partition dim and stride): split along
    `dim` over its tensor group, so every rank's part counts (grad norm, parameter counts)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """megatron-core's `tensor_model_parallel`: set by its layers on parameters split over TP ranks."""
    return bool(getattr(param, "tensor_model_parallel", False))


def set_main_grad_only(param: torch.Tensor, value: bool) -> None:
    """Ours, set by the training wrapper: DDP reduces after backward, so the sparse experts may add
    this weight's gradient into main_grad outside autograd (read by moe/experts/sparse.py)."""
    param.main_grad_only = value


def main_grad_only(param: torch.Tensor) -> bool:
    """Set by set_main_grad_only (default False); read by the sparse experts' backward."""
    return getattr(param, "main_grad_only", False)


def set_fuse_wgrad_accumulation(param: torch.Tensor, value: bool) -> None:
    """Ours: False stops the sparse experts adding this weight's gradient into main_grad in the kernel."""
    param.fuse_wgrad_accumulation = value


def fuses_wgrad_accumulation(param: torch.Tensor) -> bool:
    """Set by set_fuse_wgrad_accumulation (default True); read by the sparse experts' backward."""
    return getattr(param, "fuse_wgrad_accumulation", True)


def main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """megatron-core's `main_grad`: the parameter's view of DDP's gradient buffer; None without DDP."""
    return getattr(param, "main_grad", None)


def set_grad_added_to_main_grad(param: torch.Tensor, value: bool) -> None:
    """megatron-core's `grad_added_to_main_grad`: True makes DDP's hook drop param.grad unadded."""
    param.grad_added_to_main_grad = value


def zero_out_wgrad(param: torch.Tensor) -> bool:
    """megatron-core's `zero_out_wgrad` (shared embeddings): a fused gradient's placeholder is zeros."""
    return getattr(param, "zero_out_wgrad", False)
