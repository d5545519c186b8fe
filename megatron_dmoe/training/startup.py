"""The first lines of a run: where it writes, what it trains on, how big the model is."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dmoe.config import RunConfig
from megatron_dmoe.parallel.distributed import DistEnv
from megatron_dmoe.parallel.param_roles import is_expert_parallel, is_tensor_parallel


def human_count(n: float) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return f"{n:.0f}"


def describe_device(cfg: RunConfig, env: DistEnv) -> str:
    precision = "bf16" if cfg.training.bf16 else "fp16" if cfg.training.fp16 else "fp32"
    name = torch.cuda.get_device_name(env.device) if env.on_cuda else "cpu"
    processes = f"{env.world_size} process" + ("es" if env.world_size > 1 else "")
    backend = dist.get_backend() if dist.is_initialized() else "none"
    return f"{name}, {processes} ({backend}), {precision}"


def describe_data(cfg: RunConfig, data) -> str:
    if cfg.data.data_path:
        source = f"{' '.join(cfg.data.data_path)} (tokenizer {cfg.data.tokenizer_model})"
    else:
        source = (f"built-in corpus (Python standard library; tokenizer vocabulary "
                  f"{cfg.data.builtin_vocab_size})")
    valid = f", {len(data.valid)} validation" if data.valid is not None else ""
    return (f"{source}: {len(data.train)} training{valid} sequences of {cfg.model.seq_length} "
            f"tokens")


def parameter_counts(model, cfg: RunConfig, device: torch.device) -> Tuple[int, int]:
    """(all parameters, parameters each token passes through) of the whole model, all ranks.

    Expert weights (`is_expert_parallel`) are summed over the expert-parallel
    ranks, tensor-parallel slices over the tensor-parallel ranks, and everything over pipeline
    stages. A token passes through top_k of num_experts experts in each MoE layer.
    """
    split = replicated = expert = 0
    chunks = [model] if isinstance(model, torch.nn.Module) else model  # or its virtual-stage chunks
    for param in (p for chunk in chunks for p in chunk.parameters()):
        if getattr(param, "shared", False):
            continue  # the last pipeline stage's copy of tied embeddings
        if is_expert_parallel(param):
            expert += param.numel()
        elif is_tensor_parallel(param):
            split += param.numel()
        else:
            replicated += param.numel()
    counts = [torch.tensor([float(c)], dtype=torch.float64, device=device) for c in (split, replicated, expert)]
    if dist.is_initialized():
        dist.all_reduce(counts[0], group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(counts[2], group=ps.get_expert_model_parallel_group())
        for c in counts:
            dist.all_reduce(c, group=ps.get_pipeline_model_parallel_group())
    dense, experts = counts[0].item() + counts[1].item(), counts[2].item()
    active = experts * cfg.moe.top_k / cfg.moe.num_experts if cfg.moe.num_experts else 0
    return int(dense + experts), int(dense + active)


def describe_model(model, cfg: RunConfig, device: torch.device) -> str:
    total, active = parameter_counts(model, cfg, device)
    moe = (f", {cfg.moe.num_experts} experts, top-{cfg.moe.top_k}" if cfg.moe.num_experts
           else ", dense")
    return (f"{human_count(total)} parameters, {human_count(active)} active per token "
            f"({cfg.model.num_layers} layers x {cfg.model.hidden_size}{moe})")
