"""The Adam step of a distributed-optimizer part that holds no parameters on this rank.

megatron-core (0.16 through 0.19; checked: 0.16.1, 0.19.1) gives every rank the same parameter
groups, so a rank whose pipeline stage has no MoE layer (moe.first_dense_layers, or dense layers
between MoE layers) still gets an expert-parallel DistributedOptimizer, with empty groups. Without
Transformer Engine or apex, its `state_dict` reads Adam's step from torch's per-parameter state,
of which an empty optimizer has none, and asserts `len(steps) == 1`: such a rank could neither save
nor load a checkpoint. The parameter groups it writes, step included, are common state, which rank
0 alone saves and every rank loads: where rank 0's stage holds no experts, the expert parameters
of the other stages resume with rank 0's step. So the empty part writes the step of the other
parts on its rank, the real one (all parts step together: megatron gives every main parameter a
gradient and skips a step for all or none).

Could go once upstream's `DistributedOptimizer.state_dict` takes the step from elsewhere when its
torch optimizer holds no state (the ChainedOptimizer knows the other parts' step).
"""
from __future__ import annotations

from typing import Set

import torch

from megatron_dmoe.compat.patching import patched


def _holds_parameters(part) -> bool:
    return any(group["params"] for group in part.optimizer.param_groups)


def _adam_steps(part) -> Set[float]:
    """The step counts in torch's per-parameter state of this part (empty before its first step)."""
    return {float(state["step"]) for state in part.optimizer.state.values() if "step" in state}


def share_step_with_empty_parts(optimizer) -> None:
    """Each distributed part of `optimizer` (chained or not) that holds no parameters on this rank
    writes the step of the other parts into its state dict (idempotent; only where megatron-core
    reads the step from torch's Adam, i.e. without Transformer Engine or apex)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    for part in parts:
        if (not isinstance(part, distrib_optimizer.DistributedOptimizer) or _holds_parameters(part)
                or getattr(part.state_dict, "_step_of_other_parts", False)):
            continue
        others = [other for other in parts if other is not part]

        def state_dict(_part=part, _original=part.state_dict, _others=others):
            steps = set().union(*(_adam_steps(other) for other in _others))
            if len(steps) != 1:  # none (or several) on this rank: megatron-core's own answer, its assertion
                return _original()
            inner, step = _part.optimizer.state_dict, torch.tensor(steps.pop())
            # megatron-core takes the step from the inner state, then drops that state: one entry holding it
            with patched(_part.optimizer, "state_dict", lambda: {**inner(), "state": {0: {"step": step}}}):
                return _original()

        state_dict._step_of_other_parts = True
        part.state_dict = state_dict
