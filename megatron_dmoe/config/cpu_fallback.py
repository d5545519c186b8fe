"""A run that lands on a CPU trains in fp32 even when its config asks for bf16 or fp16.

The shipped GPU configs (the zoo) ask for bf16, which megatron-core's mixed-precision optimizer
supports on CUDA only. Running one on a CPU is still useful (a smoke test, a tiny variant), so
the CPU run drops the 16-bit setting and says so, instead of refusing. `validate` keeps refusing
16-bit CPU configs for callers that check a config for a machine (sweeps).
"""
from __future__ import annotations

import copy
from typing import List, Tuple

from .schema import RunConfig


def runs_on_cpu(cfg: RunConfig, cuda_available: bool) -> bool:
    device = cfg.training.device
    return device == "cpu" or (device == "auto" and not cuda_available)


def cpu_precision_fallback(cfg: RunConfig, cuda_available: bool) -> Tuple[RunConfig, List[str]]:
    """``cfg`` with bf16/fp16 off when it runs on a CPU, and one notice per key turned off."""
    if not runs_on_cpu(cfg, cuda_available):
        return cfg, []
    out, notices = copy.deepcopy(cfg), []
    for key in ("bf16", "fp16"):
        if getattr(out.training, key):
            setattr(out.training, key, False)
            notices.append(f"note: training.{key}: true needs CUDA; this CPU run trains in fp32 "
                           f"(training.{key}=false)")
    return out, notices
