"""The distributed optimizer's reshardable checkpoint loaded into torch's Adam.

Without Transformer Engine or apex, megatron-core's distributed optimizer (0.16 through 0.19;
checked: 0.16.1, 0.19.1) runs torch's Adam, which keeps a 'step' with each parameter's moments.
The reshardable checkpoint keeps the step in the parameter groups instead (`load_state_dict`
restores it from there into every parameter's state), and its loader
(`load_parameter_state_from_fully_reshardable`) leaves 'step' out of each parameter's loaded
tensors, then copies every state entry the optimizer has from them: a KeyError on 'step', so no
such checkpoint resumed on GPUs. Here entries the checkpoint lacks keep their restored values.
Could go once upstream copies only the entries the checkpoint holds.
"""
from __future__ import annotations

import functools


def keep_restored_adam_step() -> None:
    """Make DistributedOptimizer._set_main_param_and_optimizer_states copy only the entries it is
    given (idempotent)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_keeps_unsaved_entries", False):
        return

    @functools.wraps(original)
    def set_saved_states(self, model_param, tensors):
        return original(self, model_param, {**self._get_main_param_and_optimizer_states(model_param), **tensors})

    set_saved_states._keeps_unsaved_entries = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_saved_states
