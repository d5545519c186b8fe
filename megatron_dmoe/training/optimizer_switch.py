"""Resume with the distributed optimizer switched on or off.

The two optimizers save their state in different structures: the distributed one as per-parameter
tensors `optimizer.state.{param,exp_avg,exp_avg_sq}.<weight>` beside its chained parameter groups,
megatron's other optimizers as torch's Adam state (`optimizer.state.{exp_avg,exp_avg_sq}.<weight>`,
`optimizer.state.fp32_param.<weight>` for 16-bit weights) with a common step. Each loads only its
own. The tensors are keyed by the model's weights in both, so a switched resume reads them for the
weights this rank holds, in whichever layout it now has, and puts them where the optimizer it has
now keeps them; the step count comes from the saved common state. Learning rates come from the
scheduler's own state, and a 16-bit run's loss scale starts afresh.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

MOMENTS = ("exp_avg", "exp_avg_sq")
# where each optimizer saves the fp32 main weights of 16-bit parameters
MAIN_KEY = {True: "param", False: "fp32_param"}


def _walk(tree) -> Iterator[Tuple[object, object]]:
    """(key, value) pairs of every dict inside `tree`, depth first."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _walk(value)


def saved_with_distributed_optimizer(common_optimizer_state) -> bool:
    return any(key == "param_state_sharding_type" for key, _ in _walk(common_optimizer_state))


def saved_step(common_optimizer_state) -> Optional[float]:
    """The Adam step count a checkpoint saved (the same for every parameter)."""
    for key, value in _walk(common_optimizer_state):
        if key in ("common_step", "step") and value is not None:
            return float(value)
    return None


def _sharded_weights(model_sharded_state_dicts: List[dict]) -> Dict[torch.Tensor, object]:
    """Each weight tensor of this rank -> its sharded description in the checkpoint."""
    found = {}
    for sharded in model_sharded_state_dicts:
        for value in nested_values(sharded):
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                found[value.data] = value
    return found


def _template(weights: Dict[torch.Tensor, object], names: Tuple[str, ...]) -> dict:
    """What to read: for every weight, a float32 tensor of its shape per state name."""
    template = {}
    for i, sharded in enumerate(weights.values()):
        template[i] = {name: replace(sharded, key=f"optimizer.state.{name}.{sharded.key}",
                                     data=torch.zeros(sharded.data.shape, dtype=torch.float32),
                                     **({} if isinstance(sharded, ShardedTensorFactory) else {"dtype": torch.float32}))
                       for name in names}
    return template


def load_switched_optimizer_state(path, model_chunks, model_sharded_state_dicts, optimizer,
                                  saved_distributed: bool, common_optimizer_state) -> None:
    """Fill `optimizer` (distributed or not) from a checkpoint saved by the other kind."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    weights = _sharded_weights(model_sharded_state_dicts)
    # megatron's sharded state dicts hold the parameters themselves (keep_vars)
    params = {id(p): p for chunk in model_chunks for p in chunk.parameters()}
    sixteen_bit = any(p.dtype in (torch.bfloat16, torch.float16) for p in params.values())
    names = MOMENTS + ((MAIN_KEY[saved_distributed],) if sixteen_bit else ())
    loaded = dist_checkpointing.load(_template(weights, names), str(path))
    step = saved_step(common_optimizer_state) or 0.0
    state_of = {}
    for i, weight in enumerate(weights):
        param = params.get(id(weight))
        if param is not None:
            state = loaded[i]
            main = state.get(MAIN_KEY[saved_distributed])
            state_of[param] = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                               "param": main if main is not None else param.detach().float()}
    with torch.no_grad():  # the distributed optimizer's fp32 main weights are views of the parameters
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(part, DistributedOptimizer):
                _fill_distributed(part, state_of, step)
            else:
                _fill_local(part, state_of, step)


def _adam_step(state: dict, step: float) -> torch.Tensor:
    """The step count where torch's Adam keeps it for this parameter (CPU, or the device when fused)."""
    kept = state.get("step")
    if isinstance(kept, torch.Tensor):
        return torch.full_like(kept, step)
    return torch.tensor(step, dtype=torch.float32)


def _fill_distributed(part, state_of: dict, step: float) -> None:
    """Through megatron's own loader of the reshardable format, which takes each parameter's whole
    tensors in its buffers' order and keeps this rank's range of them."""
    in_buffer_order = [state_of.get(model_param, {}) for buffer in part.buffers
                       for model_param in buffer.param_index_map]
    part.load_parameter_state_from_fully_reshardable(dict(enumerate(in_buffer_order)))
    for group in part.optimizer.param_groups:
        for main in group["params"]:
            state = part.optimizer.state[main]
            state["step"] = _adam_step(state, step)


def _main_params(part) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the tensor torch's Adam steps for it) of a non-distributed optimizer."""
    if hasattr(part, "float16_groups"):  # 16-bit weights with fp32 main copies
        for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups):
            yield from zip(model_group, main_group)
        for group in part.fp32_from_fp32_groups:
            for param in group:
                yield param, param
    else:
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                yield param, param


def _fill_local(part, state_of: dict, step: float) -> None:
    for model_param, main in _main_params(part):
        saved = state_of.get(model_param)
        if saved is None:
            continue
        if main is not model_param:
            main.data.copy_(saved["param"].view_as(main))
        state = part.optimizer.state[main]
        state["step"] = _adam_step(state, step)
        for key in MOMENTS:
            state[key] = saved[key].view_as(main).to(main.device).clone()
