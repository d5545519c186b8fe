"""Where the transformer layers can be captured as CUDA graphs (`training.cuda_graphs`).

One set of rules serves two uses: `validate` refuses `true` where capture would be incorrect, and
model/cuda_graphs_auto.py turns `auto` (the default) into true or false once, at start-up: false
with one note naming the reason. Captured layers must issue the same work every step without the
host reading device values.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Tuple

KEY = "training.cuda_graphs"
EP_KEY = "parallel.expert_model_parallel_size"
ETP_KEY = "parallel.expert_tensor_parallel_size"
PP_KEY = "parallel.pipeline_model_parallel_size"
TP_KEY = "parallel.tensor_model_parallel_size"
# the keys the rules read; validate passes those whose values are valid
RULE_KEYS = ("training.device", EP_KEY, ETP_KEY, PP_KEY, TP_KEY, "moe.ep_exchange", "moe.num_experts", "moe.backend",
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
    ep, etp = get(EP_KEY) or 1, get(ETP_KEY) or 1
    if ep * etp > 1 and get("moe.ep_exchange") == "nccl":
        sizes = f"{EP_KEY} = {ep}" + (f", {ETP_KEY} = {etp}" if etp > 1 else "")
        found.append((f"the NCCL expert-parallel exchange ({sizes}, moe.ep_exchange: nccl) reads its "
                      "split sizes on the host",
                      f"use moe.ep_exchange: symmetric or auto (GPUs of one host) {STRICT_FIX}"))
    tp = get(TP_KEY) or 1
    if tp > 1:
        # on two GPUs five TP 2 + SP steps eager and then captured did not finish in 250 s, where
        # eager ones take seconds: refused until a captured run is shown to match an eager one
        found.append((f"tensor parallelism ({TP_KEY} = {tp}) has no captured layers", f"use 1 {STRICT_FIX}"))
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
