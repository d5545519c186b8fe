"""logging.*: Weights & Biases logging needs its project, and the wandb package installed."""
from __future__ import annotations

from ..environment import wandb_available
from .state import CheckState

_WANDB_KEYS = ("logging.wandb_exp_name", "logging.wandb_save_dir", "logging.wandb_mode")


def check(state: CheckState) -> None:
    v, ok, key = state.v, state.ok, "logging.wandb_project"
    if not ok(key):
        return
    if not v(key):
        for other in _WANDB_KEYS:
            if ok(other) and v(other) is not None:
                state.problem(other, f"is used only with {key} (W&B logging is off without a project); set "
                              f"{key}, or leave {other} unset")
        return
    if not wandb_available():
        state.problem(key, "W&B logging needs the Python package wandb, which cannot be imported here; pip "
                      "install 'megatron-dmoe[wandb]' (or wandb), or leave logging.wandb_project unset")
