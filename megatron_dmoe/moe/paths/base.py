"""What every MoE execution path is: `forward(layer, x, valid, num_sequences) -> y`."""
from __future__ import annotations

import abc
from typing import Optional

import torch

from ..aux_loss import AuxLossScaler


class MoEPath(abc.ABC):
    """One way of running an MoELayer, fixed when the layer is built: no per-call choice.

    forward gets the layer (router, experts, shared experts, aux losses), the tokens x [T, h], the
    valid-token mask [T] (None without padding) and the number of sequences; returns y [T, h]."""

    name: str

    @abc.abstractmethod
    def forward(self, layer, x: torch.Tensor, valid: Optional[torch.Tensor], num_sequences: int) -> torch.Tensor:
        ...

    def use_run_state(self, state) -> None:
        """The run's shared state (expert exchanges, ...), for a path that keeps some of it."""


class DispatchedPath(MoEPath):
    """A path whose experts run on dispatched rows: route, dispatch, the aux losses riding on the
    experts' input, the shared experts issued while the rows move, the experts, the combine."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher

    @abc.abstractmethod
    def run_experts(self, layer, rows: torch.Tensor, tokens_per_expert, state) -> torch.Tensor:
        """The experts' outputs for the dispatched `rows` (in the dispatcher's order)."""

    def forward(self, layer, x, valid, num_sequences):
        routing = layer.router(x, valid)
        rows, tokens_per_expert, state = self.dispatcher.dispatch(x, routing.indices, routing.weights)
        aux_loss = layer.aux_losses(routing, valid, num_sequences)
        if aux_loss is not None:
            # the experts' input is not modified in place, so it is returned as is (a view)
            rows = AuxLossScaler.apply(rows, aux_loss, False)
        # issued while the exchange (if any) is in flight, before anything waits on its result
        shared = layer.shared_experts.start(x) if layer.shared_experts is not None else None
        y = self.experts_and_combine(layer, rows, tokens_per_expert, state)
        return y if shared is None else y + layer.shared_experts.finish(shared)

    def experts_and_combine(self, layer, rows: torch.Tensor, tokens_per_expert, state) -> torch.Tensor:
        """y [T, h]: the experts on the dispatched rows, combined per token."""
        return self.dispatcher.combine(self.run_experts(layer, rows, tokens_per_expert, state), state)


class UnavailablePath(MoEPath):
    """The configured backend cannot run on the weights' device or dtype (a model built on CPU to be
    moved to a GPU, say): building succeeds, running says why (the error resolving it raised)."""

    name = "unavailable"

    def __init__(self, error: Exception):
        self.error = error

    def forward(self, layer, x, valid, num_sequences):
        raise self.error

