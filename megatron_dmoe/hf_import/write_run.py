"""Write the run directory of a checked import (plan.py): the tokenizer files, then the run as
dmoe-train builds it at step 0 (resolved config.yaml, the model, a fresh optimizer and learning-rate
schedule; the data checked when there is some), the model's weights replaced by the checkpoint's,
saved as the checkpoint of step 0.

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
from megatron_dmoe.export.hf_weights import from_hf
from megatron_dmoe.export.tokenizer_files import copy_tokenizer_folder
from megatron_dmoe.hf_import.plan import TOKENIZER_DIR, ImportPlan
from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.inference.no_data import build_run_tokenizer, has_no_data


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


def _build_run(cfg, env, run_dir: Path):
    """(model chunks, optimizer, scheduler) as training builds them at step 0, after the checks that
    need no model: the data when the import names some (as training will read it), else the
    tokenizer alone. Writes config.yaml. Raises DataError."""
    from megatron_dmoe.model.gpt import build_model_chunks
    from megatron_dmoe.moe import MoERunState
    from megatron_dmoe.parallel.distributed import seed_everything
    from megatron_dmoe.training.optim import build_optimizer, build_scheduler
    from megatron_dmoe.training.run_dir import software_versions, write_run_config
    from megatron_dmoe.training.setup import describe_data, describe_model, prepare_run_data, wrap_for_training

    if has_no_data(cfg):
        build_run_tokenizer(cfg)
        print("data: none (give data.data_path=PREFIX when training)", flush=True)
    else:
        print(f"data: {describe_data(cfg, prepare_run_data(cfg, env))}", flush=True)
    seed_everything(cfg.training.seed, env)
    model = build_model_chunks(cfg, vocab_size=cfg.model.vocab_size, on_cuda=env.on_cuda, run_state=MoERunState())
    print(f"model: {describe_model(model, cfg, env.device)}", flush=True)
    model = wrap_for_training(model, cfg.training.use_distributed_optimizer)
    optimizer = build_optimizer(cfg, model, env.on_cuda)
    scheduler = build_scheduler(cfg, optimizer)
    write_run_config(cfg, run_dir, False, software_versions())
    return model, optimizer, scheduler


def write_run(plan: ImportPlan) -> Path:
    """The checkpoint directory written; torch.distributed must not be running yet (this starts it)."""
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed
    from megatron_dmoe.training.checkpoint import Progress, save_checkpoint
    from megatron_dmoe.training.optim import init_empty_adam_states
    from megatron_dmoe.training.run_dir import checkpoint_root
    from megatron_dmoe.training.setup import release_after_training

    run_dir, cfg = plan.run_dir, plan.cfg
    created = not run_dir.exists()
    tokenizer = run_dir / TOKENIZER_DIR
    done = False
    try:
        tokenizer.mkdir(parents=True)
        copy_tokenizer_folder(plan.hf_dir, tokenizer)
        env = init_distributed(cfg.training.device)
        try:
            model, optimizer, scheduler = _build_run(cfg, env, run_dir)
            load_hf_weights(model[0], plan)
            optimizer.reload_model_params()  # 16-bit runs: their fp32 main weights
            init_empty_adam_states(optimizer)  # the state a first step would start from
            save_zero_step_count(optimizer)  # compat/optimizer_zero_step.py
            path = save_checkpoint(checkpoint_root(run_dir), model, optimizer, scheduler, Progress(),
                                   keep_last=cfg.checkpoint.keep_last)
            release_after_training(model)
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
