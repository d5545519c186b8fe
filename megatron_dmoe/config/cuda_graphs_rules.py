"""Where the transformer layers can be captured as CUDA graphs (`training.cuda_graphs`).

One set of rules serves two uses: `validate` refuses `true` where capture would be incorrect, and
`resolve_cuda_graphs` turns `auto` (the default) into true or false once, at start-up: false with
one note naming the reason. Captured layers must issue the same work every step without the host
reading device values.
"""
from __future__ import annotations

import copy
import os
from typing import Any, List, Mapping, Optional, Tuple

from .schema import RunConfig

KEY = "training.cuda_graphs"
EP_KEY = "parallel.expert_model_parallel_size"
PP_KEY = "parallel.pipeline_model_parallel_size"
# the keys the rules read; validate passes those whose values are valid
RULE_KEYS = ("training.device", EP_KEY, PP_KEY, "moe.ep_exchange", "moe.num_experts", "moe.backend",
             "training.recompute_granularity")
STRICT_FIX = "or set training.cuda_graphs: false"
Refusal = Tuple[str, str]  # (why capture is not correct here, what to change to capture)


def capture_refusals(values: Mapping[str, Any], cuda: bool) -> List[Refusal]:
    """Every reason these settings cannot be captured; `values` maps RULE_KEYS to their values (a
    key left out is not checked). The first two (no CUDA) come alone."""
    get = values.get
    device = get("training.device")
    if device == "cpu":
        return [("graph capture needs CUDA, but training.device is cpu", "set it to false")]
    if not cuda:
        return [("graph capture needs CUDA, which is not available here", "set it to false")]
    found = []
    ep = get(EP_KEY) or 1
    if ep > 1 and get("moe.ep_exchange") == "nccl":
        found.append((f"the NCCL expert-parallel exchange ({EP_KEY} = {ep}, moe.ep_exchange: nccl) reads its "
                      "split sizes on the host",
                      f"use moe.ep_exchange: symmetric or auto (GPUs of one host) {STRICT_FIX}"))
    pp = get(PP_KEY) or 1
    if pp > 1:
        found.append((f"pipeline parallelism ({PP_KEY} = {pp}) has no captured schedule yet", f"use 1 {STRICT_FIX}"))
    recompute = get("training.recompute_granularity")
    if recompute is not None:
        # megatron-core's per-layer graphs take full recompute only inside a whole-iteration graph,
        # and a recomputed forward inside backward loses the captured buffers' bookkeeping
        found.append((f"activation recompute (training.recompute_granularity: {recompute}) re-runs the "
                      "layers' forward inside backward, which megatron-core's per-layer graphs do not capture",
                      f"set it to null {STRICT_FIX}"))
    if (get("moe.num_experts") or 0) > 0 and get("moe.backend") == "reference":
        found.append(("moe.backend: reference reads the expert counts on the host",
                      f"use sparse, grouped or auto {STRICT_FIX}"))
    return found


def _auto_only_refusal(cfg: RunConfig, world_size: int, local_world_size: int) -> Optional[str]:
    """Reasons that make `auto` run eagerly although `true` is allowed (the user chose otherwise)."""
    moe, par = cfg.moe, cfg.parallel
    if moe.num_experts > 0 and moe.expert_wgrad_per_step:
        return ("moe.expert_wgrad_per_step: true defers the expert weight gradients to the step's end, "
                "which captured layers cannot (they accumulate per micro-batch)")
    if (moe.num_experts > 0 and par.expert_model_parallel_size > 1 and moe.ep_exchange == "auto"
            and world_size > local_world_size):
        return (f"the run spans hosts ({world_size} processes, {local_world_size} per host), where "
                "moe.ep_exchange: auto may take the NCCL exchange, which reads its split sizes on the host")
    if moe.num_experts > 0 and moe.backend == "auto":
        from megatron_dmoe.moe.experts.backends import resolve_backend

        dtype = _params_dtype(cfg)
        shards = max(1, par.expert_model_parallel_size // moe.num_experts)
        backend = resolve_backend("auto", "cuda", dtype, cfg.model.hidden_size, moe.ffn_hidden_size // shards)
        if backend.name == "reference":
            return "moe.backend: auto picks the reference experts here, which read the expert counts on the host"
    return None


def _params_dtype(cfg: RunConfig):
    import torch

    return torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32


def resolve_cuda_graphs(cfg: RunConfig, cuda: bool, world_size: Optional[int] = None,
                        local_world_size: Optional[int] = None) -> Tuple[RunConfig, List[str]]:
    """``cfg`` with `training.cuda_graphs: auto` replaced by true or false, and the note saying why
    when false; a config that says true or false comes back as it is. `cfg` is resolved and valid."""
    if cfg.training.cuda_graphs != "auto":
        return cfg, []
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = local_world_size if local_world_size is not None else \
        int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    values = {key: _value(cfg, key) for key in RULE_KEYS}
    refusals = capture_refusals(values, cuda)
    why = refusals[0][0] if refusals else (_auto_only_refusal(cfg, world_size, local_world_size))
    out = copy.deepcopy(cfg)
    out.training.cuda_graphs = why is None
    # a run without CUDA has no graphs to miss: saying so on every CPU run would be noise
    on_cuda = cuda and values["training.device"] != "cpu"
    notes = [] if why is None or not on_cuda else [
        f"note: training.cuda_graphs: auto runs the layers eagerly here: {why} (training.cuda_graphs=false)"]
    return out, notes


def _value(cfg: RunConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
