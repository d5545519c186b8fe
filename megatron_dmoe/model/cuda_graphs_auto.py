"""`training.cuda_graphs: auto` turned into true or false once, at start-up: the rules of `true`
(config/cuda_graphs_rules.py) and those only `auto` has, such as the expert backend `auto` picks here."""
from __future__ import annotations

import copy
import os
from typing import Any, List, Optional, Tuple

from megatron_dmoe.config import RunConfig
from megatron_dmoe.config.cuda_graphs_rules import RULE_KEYS, capture_refusals
from megatron_dmoe.config.environment import transformer_engine_available
from megatron_dmoe.model.transformer_config import params_dtype
from megatron_dmoe.moe.experts.backends import resolve_backend
from megatron_dmoe.parallel.distributed import ranks_per_host
from megatron_dmoe.parallel.layout_rules import ffn_shards_per_expert


def resolve_cuda_graphs(cfg: RunConfig, cuda: bool, world_size: Optional[int] = None,
                        local_world_size: Optional[int] = None) -> Tuple[RunConfig, List[str]]:
    """``cfg`` with `training.cuda_graphs: auto` replaced by true or false, and the note saying why
    when false; a config that says true or false comes back as it is. `cfg` is resolved and valid."""
    if cfg.training.cuda_graphs != "auto":
        return cfg, []
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = local_world_size if local_world_size is not None else ranks_per_host(world_size)
    values = {key: _value(cfg, key) for key in RULE_KEYS}
    refusals = capture_refusals(values, cuda, transformer_engine_available())
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


def _auto_only_refusal(cfg: RunConfig, world_size: int, local_world_size: int) -> Optional[str]:
    """Reasons that make `auto` run eagerly although `true` is allowed (the user chose otherwise)."""
    moe, par = cfg.moe, cfg.parallel
    if moe.num_experts > 0 and par.expert_tensor_parallel_size > 1:
        # expert parallelism's captured runs match eager ones on GPUs; experts split over ranks have
        # not been shown to, so auto leaves them eager and `true` captures them on request
        return (f"experts split over ranks (parallel.expert_tensor_parallel_size = "
                f"{par.expert_tensor_parallel_size}) are captured only on request (training.cuda_graphs: true)")
    if moe.num_experts > 0 and moe.expert_wgrad_per_step:
        return ("moe.expert_wgrad_per_step: true defers the expert weight gradients to the step's end, "
                "which captured layers cannot (they accumulate per micro-batch)")
    exchange = par.expert_model_parallel_size * par.expert_tensor_parallel_size > 1
    if (moe.num_experts > 0 and exchange and moe.ep_exchange == "auto"
            and world_size > local_world_size):
        return (f"the run spans hosts ({world_size} processes, {local_world_size} per host), where "
                "moe.ep_exchange: auto takes the NCCL exchange, which reads its split sizes on the host; "
                "moe.ep_exchange: nvshmem keeps them on the device and is captured")
    if moe.num_experts > 0 and moe.backend == "auto":
        dtype = params_dtype(cfg)
        shards = ffn_shards_per_expert(moe.num_experts, par.expert_model_parallel_size,
                                       par.expert_tensor_parallel_size)
        backend = resolve_backend("auto", "cuda", dtype, cfg.model.hidden_size, moe.ffn_hidden_size // shards)
        if backend.name == "reference":
            return "moe.backend: auto picks the reference experts here, which read the expert counts on the host"
    return None

