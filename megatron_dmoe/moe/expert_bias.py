"""Aux-loss-free load balancing: the training loop moves every router's expert bias after each step."""
from __future__ import annotations

from typing import Iterable, Union

import torch

from .router import TopKRouter


def _default_group():
    """The tensor- and data-parallel group (with context parallelism) when megatron's groups exist,
    else WORLD: under sequence parallelism the tensor-parallel ranks route different tokens (without
    it they route the same ones, and the sign of every update is unchanged)."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None


def update_expert_biases(model: Union[torch.nn.Module, Iterable[torch.nn.Module]], group=None) -> int:
    """bias += rate * sign(mean load - load) for every router with an expert bias; counts reset.

    `model` is a module or a list of model chunks. The loads counted since the last update are
    summed over `group` (default: the tensor- and data-parallel group) in one all-reduce when
    torch.distributed is initialised, so every rank applies the same update. Returns the number
    of routers updated.
    """
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    routers = [
        m for chunk in modules for m in chunk.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None
    ]
    if not routers:
        return 0
    loads = torch.stack([r.local_tokens_per_expert for r in routers])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loads, group=group if group is not None else _default_group())
    for router, load in zip(routers, loads):
        router.apply_bias_update(load)
    return len(routers)
