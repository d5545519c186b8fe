"""Before a resume builds anything: does the requested config fit the run's checkpoints?

A checkpoint fixes the shapes of every weight and of the optimizer state, and megatron-core's
learning-rate scheduler refuses a checkpoint whose schedule differs. Comparing the run's saved,
resolved config.yaml with the requested one finds such a mismatch in a second and names the key,
instead of a shape-mismatch traceback after the model is built.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from megatron_dmoe.config import RunConfig, config_to_dict

# Keys that may differ on resume: how long to train, how to evaluate, log and checkpoint, how the
# work is laid out (dist_checkpointing reshards) and which kernels compute the same model.
MAY_CHANGE_SECTIONS = ("parallel", "checkpoint", "logging")
MAY_CHANGE = {
    "model.hidden_dropout", "model.attention_dropout", "model.init_method_std",
    "model.cross_entropy_loss_fusion", "model.cross_entropy_fusion_impl",
    "moe.backend", "moe.block_size", "moe.memory_optimized", "moe.expert_wgrad_per_step",
    "moe.ep_exchange", "moe.aux_loss_coeff", "moe.z_loss_coeff", "moe.router_bias_update_rate",
    "moe.input_jitter_eps",
    "training.train_iters", "training.time_limit_minutes", "training.micro_batch_size", "training.eval_interval",
    "training.eval_iters", "training.recompute_granularity", "training.cuda_graphs",
    "training.device", "training.clip_grad", "training.adam_beta1", "training.adam_beta2",
    "training.adam_eps", "training.loss_scale", "training.initial_loss_scale", "training.use_distributed_optimizer",
    "data.cache_dir", "data.num_workers",
}

Mismatch = Tuple[str, Any, Any]  # (dotted key, saved value, requested value)


def resume_mismatches(saved: RunConfig, requested: RunConfig) -> List[Mismatch]:
    """Keys the run's checkpoints depend on whose values differ; both configs resolved."""
    old, new = config_to_dict(saved), config_to_dict(requested)
    found = []
    for section, values in old.items():
        if section in MAY_CHANGE_SECTIONS:
            continue
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if dotted not in MAY_CHANGE and new[section][key] != value:
                found.append((dotted, value, new[section][key]))
    return found


def mismatch_message(run_dir, mismatches: List[Mismatch]) -> str:
    """One line: what differs, and what to do."""
    differences = "; ".join(f"{key} was {saved!r}, now {requested!r}" for key, saved, requested in mismatches)
    return (f"cannot resume {run_dir}: its checkpoints were saved with a different configuration "
            f"({differences}); drop those overrides to continue the run (its config.yaml has the saved "
            f"values), or start a new run with another --run-dir")
