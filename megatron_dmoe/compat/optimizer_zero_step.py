"""An optimizer checkpoint saved before the first step that megatron-core can load again.

megatron-core (0.16 through 0.19, checked: 0.16.1, 0.19.1) saves Adam's step count shared by all
parameters (`common_step`) only when it is not 0 (`if step:` in the optimizers' sharded_state_dict);
its loader then hands torch's Adam states without a step, which torch refuses: a checkpoint saved
before the first step (dmoe-import's) could not be resumed. Could go once upstream writes the step
whenever it is not None.
"""
from __future__ import annotations

import torch


def save_zero_step_count(optimizer) -> None:
    """This optimizer's (and its chained parts') checkpoint state carries a zero step count too."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = part.sharded_state_dict

        def with_step(*args, _original=original, **kwargs):
            state = _original(*args, **kwargs)
            inner = state["optimizer"] if "optimizer" in state else state
            inner["state"].setdefault("common_step", torch.zeros((), dtype=torch.float32))
            return state

        part.sharded_state_dict = with_step
