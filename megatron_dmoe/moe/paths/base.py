"""What every MoE execution path is: `forward(layer, x, valid, num_sequences) -> y`."""
from __future__ import annotations

import abc
from typing import Optional

import torch


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


class UnavailablePath(MoEPath):
    """The configured backend cannot run on the weights' device or dtype (a model built on CPU to be
    moved to a GPU, say): building succeeds, running says why (the error resolving it raised)."""

    name = "unavailable"

    def __init__(self, error: Exception):
        self.error = error

    def forward(self, layer, x, valid, num_sequences):
        raise self.error

