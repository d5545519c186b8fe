"""What extending a run does to its learning rate: a resume with a larger training.train_iters, whose
decay length follows it (training.lr_decay_iters not set), decays over the new length, so the rate at
the step where the run resumes is the new schedule's there, higher than the one the run had reached.
A warning says so, with the rates, and how to keep the saved schedule instead."""
from __future__ import annotations

from typing import Optional

from megatron_dmoe.config import RunConfig


class _NoParameters:
    """What megatron-core's OptimizerParamScheduler touches of an optimizer."""

    def __init__(self):
        self.param_groups = [{"params": []}]


def lr_at(cfg: RunConfig, step: int) -> float:
    """The learning rate the run's schedule gives after `step` steps."""
    from megatron_dmoe.training.optim import build_scheduler

    optimizer = _NoParameters()
    build_scheduler(cfg, optimizer).step(step)
    return optimizer.param_groups[0]["lr"]


def lr_jump_warning(saved: RunConfig, requested: RunConfig, step: int) -> Optional[str]:
    """The warning for a resume at `step` whose schedule gives a higher rate there than the saved
    one did (None when it does not)."""
    before, after = lr_at(saved, step), lr_at(requested, step)
    if after <= before * (1 + 1e-6):
        return None
    old = saved.training.lr_decay_iters or saved.training.train_iters
    new = requested.training.lr_decay_iters or requested.training.train_iters
    return (f"the learning rate decays over {new} steps now (was {old}): at step {step}, where the run "
            f"resumes, it jumps from {before:.2g} back up to {after:.2g} and decays again to "
            f"training.min_lr ({requested.training.min_lr:.2g}) at step {new}; pass training.lr_decay_iters={old} "
            f"to keep the saved schedule (the rate then stays at {lr_at(saved, old):.2g})")
