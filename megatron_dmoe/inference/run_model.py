"""Load a finished (or interrupted) run for inference: its config, tokenizer and a checkpoint.

The model is built exactly as training builds it (model/gpt.py) and filled through the training
checkpoint loader (dist_checkpointing, so a checkpoint saved at any expert-parallel size loads at
any other). Only what inference never uses is changed: the device, the parallel layout of this
process group, and the settings that make sense in training only (CUDA graphs, per-step weight
gradients, the block-sparse backend on a CPU, where Triton would only interpret it).
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from megatron_dmoe.config import ConfigError, ConfigWarning, RunConfig, load_config, resolve
from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.inference.no_data import build_run_tokenizer, has_no_data, validate_without_data
from megatron_dmoe.training.checkpoint import CheckpointError, checkpoint_dir, latest_iteration
from megatron_dmoe.training.run_dir import CONFIG_FILE, checkpoint_root


@dataclass
class LoadedRun:
    cfg: RunConfig  # as used for inference (see inference_config)
    model: Any  # GPTModel, inside megatron's Float16Module for bf16/fp16 runs; in eval mode
    tokenizer: Any
    vocab_size: int  # the tokenizer's (or model.vocab_size), before padding
    iteration: int  # of the loaded checkpoint
    env: Any  # DistEnv
    data: Any = None  # training.setup.RunData when asked for (with_data)


def read_run_config(run_dir: Path) -> RunConfig:
    """The resolved config.yaml of a run directory."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE} (dmoe-train writes one)")
    try:
        return resolve(load_config(str(path)))
    except ConfigError as err:
        raise UsageError(f"{path}: {err}") from None


def find_checkpoint(run_dir: Path, iteration: Optional[int] = None) -> Path:
    """The directory of checkpoint `iteration`, or of the newest complete one."""
    root = checkpoint_root(run_dir)
    done = sorted(int(p.name[len("iter_"):]) for p in root.glob("iter_*")
                  if p.is_dir() and p.name[len("iter_"):].isdigit()) if root.is_dir() else []
    if iteration is None:
        try:
            latest = latest_iteration(root) if root.is_dir() else None
        except CheckpointError as err:
            raise UsageError(str(err)) from None
        if latest is None:
            raise UsageError(f"{run_dir} has no checkpoint ({root}/latest is missing): train it first, "
                             "or give a run that saved one (checkpoint.save_interval must not be 0)")
        return checkpoint_dir(root, latest)
    path = checkpoint_dir(root, iteration)
    if iteration not in done:
        have = ", ".join(map(str, done)) or "none"
        raise UsageError(f"--checkpoint {iteration}: {path} does not exist; saved iterations: {have}")
    return path


def inference_config(cfg: RunConfig, device: str, expert_parallel: int = 1) -> RunConfig:
    """A copy of the run's config for inference on `device` with this expert-parallel size."""
    from megatron_dmoe.parallel.distributed import resolve_device

    out = copy.deepcopy(cfg)
    out.training.device = resolve_device(device)
    out.training.cuda_graphs = False
    out.moe.expert_wgrad_per_step = False
    out.parallel.tensor_model_parallel_size = 1
    out.parallel.pipeline_model_parallel_size = 1
    out.parallel.virtual_pipeline_model_parallel_size = None  # one process holds every layer
    out.parallel.sequence_parallel = False
    out.parallel.expert_model_parallel_size = expert_parallel
    out.parallel.expert_tensor_parallel_size = 1
    out.training.use_distributed_optimizer = False  # no optimizer here
    out.parallel.overlap_grad_reduce = out.parallel.overlap_param_gather = False  # nor gradients
    out.parallel.ddp_bucket_size = None
    if out.training.device == "cpu":
        if out.moe.ep_exchange in ("symmetric", "nvshmem"):
            out.moe.ep_exchange = "auto"
        out.model.transformer_impl = "local"
        if out.moe.backend == "sparse":
            out.moe.backend = "auto"  # the reference experts: the same weights and results
    return out


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def check_inference_config(cfg: RunConfig) -> None:
    """validate() for this process group's size; problems become one UsageError.

    bf16/fp16 are checked as fp32: validation refuses them on a CPU for the sake of training's
    mixed-precision optimizer, which inference does not build; the model itself runs in them. A
    run without data (no_data.py) is checked without its data paths."""
    probe = copy.deepcopy(cfg)
    probe.training.bf16 = probe.training.fp16 = False
    probe.training.loss_scale = None
    try:
        with warnings.catch_warnings():  # about training (the run showed them): not for inference
            warnings.simplefilter("ignore", ConfigWarning)
            validate_without_data(probe, _world_size())
    except ConfigError as err:
        raise UsageError(f"the run's config cannot be used here: {err}") from None


def load_run(run_dir: Path, *, device: str = "auto", checkpoint: Optional[int] = None,
             expert_parallel: int = 1, with_data: bool = False) -> LoadedRun:
    """Build the run's model in this process (group) and load a checkpoint into it.

    Bad input raises UsageError before anything is built. Starts torch.distributed (one process
    without torchrun); the caller ends it with parallel.distributed.destroy_distributed.
    with_data: also build the run's datasets (returned as .data, a training.setup.RunData).
    """
    from megatron_dmoe.data import DataError

    cfg = inference_config(read_run_config(run_dir), device, expert_parallel)
    path = find_checkpoint(run_dir, checkpoint)
    check_inference_config(cfg)
    if with_data and has_no_data(cfg):
        raise UsageError(f"{run_dir} has no data of its own (imported without data.data_path); give data "
                         "tokenized with its tokenizer (--data-path PREFIX)")

    from megatron.core.transformer.module import Float16Module

    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import init_distributed, seed_everything
    from megatron_dmoe.training.checkpoint import load_checkpoint
    from megatron_dmoe.training.setup import prepare_run_data

    env = init_distributed(cfg.training.device, 1, 1, expert_parallel)
    try:
        data = prepare_run_data(cfg, env) if with_data else None
        tokenizer = data.tokenizer if data is not None else build_run_tokenizer(cfg)
    except DataError as err:
        raise UsageError(str(err)) from None
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    seed_everything(cfg.training.seed, env)
    model = build_gpt_model(cfg, vocab_size=vocab_size, on_cuda=env.on_cuda)
    if model.config.bf16 or model.config.fp16:
        model = Float16Module(model.config, model)  # as training wraps it: fp32 logits out
    try:
        load_checkpoint(path, [model])
    except CheckpointError as err:
        raise UsageError(str(err)) from None
    model.eval()
    return LoadedRun(cfg=cfg, model=model, tokenizer=tokenizer, vocab_size=vocab_size,
                     iteration=int(path.name[len("iter_"):]), env=env, data=data)


def unwrapped(model):
    """The GPTModel inside megatron's wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


__all__: List[str] = ["LoadedRun", "load_run", "read_run_config", "find_checkpoint", "inference_config",
                      "check_inference_config", "unwrapped"]
