"""What the MoE layers of one model share while it trains, in one object the training loop creates
and owns (and passes to the model it builds), instead of module globals:

- `metrics`    the per-layer aux losses and expert loads (moe/metrics.py), logged by the loop;
- `wgrad`      the stash that defers the sparse experts' weight gradients to the step's end
               (moe/experts/per_step_wgrad.py), opened by the loop around a step's backwards;
- `exchanges`  the expert-parallel symmetric-memory exchanges, whose buffers every layer reuses
               (moe/exchange/symmetric.py);
- numbers for layers built without a layer number (their metrics' keys: -1, -2, ...).

A layer built without one gets a state of its own; `MoELayer.use_run_state` (or
`use_run_state(model, state)`) makes layers share one.
"""
from __future__ import annotations

import itertools

import torch

from .exchange.symmetric import SymmetricExchanges
from .experts.per_step_wgrad import WgradStash
from .metrics import MoEMetrics


class MoERunState:
    def __init__(self):
        self.metrics = MoEMetrics()
        self.wgrad = WgradStash()
        self.exchanges = SymmetricExchanges()
        self._unnumbered = itertools.count(1)

    def unnumbered_layer(self) -> int:
        """A key (-1, -2, ...) for the metrics of a layer that has no layer number yet."""
        return -next(self._unnumbered)


def use_run_state(model: torch.nn.Module, state: MoERunState) -> MoERunState:
    """Make every MoE layer of `model` use `state`; returns it."""
    for module in model.modules():
        if hasattr(module, "use_run_state"):
            module.use_run_state(state)
    return state


def run_state_of(model: torch.nn.Module) -> MoERunState:
    """The state the MoE layers of `model` share (a new one, given to them all, if they do not
    share one yet, or if the model has no MoE layer)."""
    states = {id(m.run_state): m.run_state for m in model.modules() if hasattr(m, "use_run_state")}
    if len(states) == 1:
        return next(iter(states.values()))
    return use_run_state(model, MoERunState())
