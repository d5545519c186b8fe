"""Write the run directory of a checked import (plan.py): the tokenizer files, then the run as
dmoe-train sets it up (resolved config.yaml, the model, a fresh optimizer and learning-rate
schedule), the model's weights replaced by the checkpoint's, saved as the checkpoint of step 0.

`dmoe-train --run-dir RUN_DIR --resume` then continues from that checkpoint like any run, at any
layout (dist_checkpointing reshards); dmoe-eval, dmoe-generate and dmoe-export read it as they read
a trained run. A failure before the checkpoint is complete removes the run directory again.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatron_dmoe.compat.optimizer_zero_step import save_zero_step_count
from megatron_dmoe.export import deepseek_weights
from megatron_dmoe.export.deepseek import DEEPSEEK_FAMILIES
from megatron_dmoe.export.moe_weights import from_hf
from megatron_dmoe.export.tokenizer_files import copy_tokenizer_folder
from megatron_dmoe.hf_import.plan import TOKENIZER_DIR, ImportPlan
from megatron_dmoe.inference.errors import UsageError


def load_hf_weights(model, plan: ImportPlan) -> None:
    """Copy the checkpoint's tensors into the (unwrapped) model, each converted to its parameter's
    dtype; UsageError naming a tensor whose shape config.json did not promise."""
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model)
    m = plan.cfg.model
    if plan.family in DEEPSEEK_FAMILIES:
        ours = deepseek_weights.from_hf(plan.files.read, m, plan.cfg.moe)
    else:
        ours = from_hf(plan.files.read, plan.family, m, model.config.kv_channels, plan.cfg.moe.num_experts)
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if "_extra_state" not in k}
    if set(targets) != set(ours):
        raise RuntimeError(f"dmoe-import: names differ: model only {sorted(set(targets) - set(ours))[:3]}, "
                           f"checkpoint only {sorted(set(ours) - set(targets))[:3]}")
    with torch.no_grad():
        for name, target in targets.items():
            source = ours[name]
            if tuple(source.shape) != tuple(target.shape):
                raise UsageError(f"{plan.hf_dir}: the tensor for {name} is {tuple(source.shape)}, the model built "
                                 f"from config.json needs {tuple(target.shape)}")
            target.copy_(source.to(device=target.device, dtype=target.dtype))


def write_run(plan: ImportPlan) -> Path:
    """The checkpoint directory written; torch.distributed must not be running yet (this starts it)."""
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed
    from megatron_dmoe.training.checkpoint import save_checkpoint
    from megatron_dmoe.training.optim import init_empty_adam_states
    from megatron_dmoe.training.setup import release_after_training, set_up_run

    run_dir, cfg = plan.run_dir, plan.cfg
    created = not run_dir.exists()
    tokenizer = run_dir / TOKENIZER_DIR
    done = False
    try:
        tokenizer.mkdir(parents=True)
        copy_tokenizer_folder(plan.hf_dir, tokenizer)
        env = init_distributed(cfg.training.device)
        try:
            run = set_up_run(cfg, env, run_dir, resume=False)
            load_hf_weights(run.model[0], plan)
            run.optimizer.reload_model_params()  # 16-bit runs: their fp32 main weights
            init_empty_adam_states(run.optimizer)  # the state a first step would start from
            save_zero_step_count(run.optimizer)  # compat/optimizer_zero_step.py
            path = save_checkpoint(run.ckpt_root, run.model, run.optimizer, run.scheduler, run.progress,
                                   keep_last=cfg.checkpoint.keep_last)
            release_after_training(run.model)
        finally:
            destroy_distributed()
        done = True
    finally:
        if not done:
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:
                shutil.rmtree(tokenizer, ignore_errors=True)
                from megatron_dmoe.training.run_dir import remove_run_files

                remove_run_files(run_dir)
    return path
