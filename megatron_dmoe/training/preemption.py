"""Turn SIGTERM (a scheduler's preemption notice) into 'save a checkpoint, then exit cleanly'."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionWatcher:
    """Records SIGTERM; `should_stop()` agrees across ranks so every rank saves at the same step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = True

    def should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
