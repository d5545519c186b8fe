"""`moe.expert_wgrad_window: auto` (the default) turned into a number once, at start-up.

A window of W micro-batches reads and writes every expert weight's fp32 main_grad once per W
micro-batches instead of once per micro-batch, and runs each weight-gradient product over W
micro-batches' rows (README, "Expert weight gradients once per step"). Its slots hold W copies of
the gradients' operands for the whole run, so `auto` takes the largest window in AUTO_WINDOWS that
divides the step's micro-batches and whose memory estimate fits under training.memory_check's share
of the GPU (0.9 where the check is off); else 1, with a note saying why. Runs whose experts do not
take windows (no MoE, a backend other than the sparse one, moe.expert_wgrad_per_step, CPU) get 1
without a note: there is nothing for them to decline. Asked-for overlapped gradient reduction
(parallel.overlap_grad_reduce: true) gets 1 with a note; its `auto` is decided after the window.
"""
from __future__ import annotations

import copy
from typing import List, Tuple

from megatron_dmoe.config import RunConfig
from megatron_dmoe.training.memory_estimate import (
    DEFAULT_MEMORY_FRACTION,
    GIB,
    estimate_memory,
    expert_backend,
    memory_limit,
    micro_batches_per_step,
)

# Largest first: the weight-gradient traffic falls as 1/W, the slots grow as W.
AUTO_WINDOWS = (8, 4, 2)


def _with_window(cfg: RunConfig, window: int) -> RunConfig:
    out = copy.deepcopy(cfg)
    out.moe.expert_wgrad_window = window
    return out


def resolve_wgrad_window(cfg: RunConfig, on_cuda: bool, world_size: int, vocab_size: int,
                         device_bytes: int) -> Tuple[RunConfig, List[str]]:
    """``cfg`` with `moe.expert_wgrad_window: auto` replaced by a number, and a note where a window
    was declined for memory; a config that gives a number comes back as it is. `cfg` is resolved
    and valid, training.cuda_graphs already true or false; device_bytes is the GPU's memory."""
    moe = cfg.moe
    if moe.expert_wgrad_window != "auto":
        return cfg, []
    if (moe.num_experts == 0 or moe.expert_wgrad_per_step or not on_cuda
            or expert_backend(cfg, on_cuda) != "sparse"):
        return _with_window(cfg, 1), []
    if cfg.parallel.overlap_grad_reduce is True:
        return _with_window(cfg, 1), [
            "note: moe.expert_wgrad_window: auto adds the expert weight gradients per micro-batch here: "
            "parallel.overlap_grad_reduce: true reduces them during backward, which a window defers"]
    steps = micro_batches_per_step(cfg, world_size)
    candidates = [w for w in AUTO_WINDOWS if steps % w == 0]
    if not candidates:
        return _with_window(cfg, 1), []
    limit = memory_limit(cfg, device_bytes) or int(DEFAULT_MEMORY_FRACTION * device_bytes)
    for window in candidates:
        resolved = _with_window(cfg, window)
        if estimate_memory(resolved, vocab_size, world_size, on_cuda=True).total <= limit:
            return resolved, []
    smallest = candidates[-1]
    need = estimate_memory(_with_window(cfg, smallest), vocab_size, world_size, on_cuda=True).total
    return _with_window(cfg, 1), [
        f"note: moe.expert_wgrad_window: auto adds the expert weight gradients per micro-batch here: a "
        f"window of {smallest} would need ~{need / GIB:.1f} GiB of the {limit / GIB:.1f} GiB allowed "
        f"(moe.expert_wgrad_window={smallest} forces it)"]
