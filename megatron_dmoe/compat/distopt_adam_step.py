"""The distributed optimizer's reshardable checkpoint loaded into torch's Adam.

Without Transformer Engine or apex, megatron-core's distributed optimizer (0.16 through 0.19;
checked: 0.16.1, 0.19.1) runs torch's Adam, which keeps a 'step' with each parameter's moments.
The reshardable checkpoint keeps the step in the parameter groups instead (`load_state_dict`
restores it from there into every parameter's state), and its loader
(`load_parameter_state_from_fully_reshardable`) leaves 'step' out of each parameter's loaded
tensors, then copies every state entry the optimizer has from them: a KeyError on 'step', so no
such checkpoint resumed on GPUs. Here entries the checkpoint lacks keep their restored values.
Could go once upstream copies only the entries the checkpoint holds.

Its `load_state_dict` also takes every parameter group whole from the checkpoint, whose groups are
the saving rank's (rank 0 writes the common state), implementation flags included: a group that
rank 0 ran as torch's multi-tensor Adam (an expert group without parameters on a stage without
experts, which training/optim.py leaves unfused) turns this rank's fused Adam into the
multi-tensor one, which refuses the `grad_scale` the folded clip hands it
(training/clip_in_adam.py). How this process runs its update is not training state: the flags
are kept, and the step counter goes where the fused kernel reads it.
"""
from __future__ import annotations

import torch

from .patching import wrapped_once

# how torch's Adam runs its update, not what it has learned
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def keep_restored_adam_state() -> None:
    """Make DistributedOptimizer's loads keep the entries the checkpoint lacks and this process's
    implementation flags of torch's Adam (idempotent)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrapped_once(DistributedOptimizer, "_set_main_param_and_optimizer_states", _copy_saved_entries_only)
    wrapped_once(DistributedOptimizer, "load_state_dict", _keep_process_flags)


def _copy_saved_entries_only(original):
    def set_saved_states(self, model_param, tensors):
        return original(self, model_param, {**self._get_main_param_and_optimizer_states(model_param), **tensors})

    return set_saved_states


def _keep_process_flags(original):
    def load_state_dict(self, state_dict):
        inner = self.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            return original(self, state_dict)
        flags = [{k: group[k] for k in IMPLEMENTATION_FLAGS if k in group} for group in inner.param_groups]
        result = original(self, state_dict)
        restore_implementation_flags(inner, flags)
        return result

    return load_state_dict


def restore_implementation_flags(inner, flags: list) -> None:
    """Give torch's Adam `inner` back the `flags` (one dict per parameter group, as taken before a
    load), with each parameter's step counter as a float32 tensor of its own on the parameter's
    device where the group is fused or capturable (the kernels read it there)."""
    for group, kept in zip(inner.param_groups, flags):
        group.update(kept)
        if not (group.get("fused") or group.get("capturable")):
            continue
        for param in group["params"]:
            state = inner.state.get(param)
            if state and "step" in state:
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32, copy=True)
