"""training.time_limit_minutes: stop once the run's training steps have taken that long."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def time_limit_reached(train_time_s: float, limit_minutes: Optional[float],
                       device: torch.device) -> bool:
    """Whether `train_time_s` seconds of training reach `limit_minutes` (None: no limit).

    Every rank gets the same answer (any rank's clock decides), so all ranks stop, evaluate and
    save at the same step.
    """
    if limit_minutes is None:
        return False
    reached = train_time_s >= limit_minutes * 60
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return reached
    flag = torch.tensor([1.0 if reached else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
