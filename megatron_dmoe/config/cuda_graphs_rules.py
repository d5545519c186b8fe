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
VPP_KEY = "parallel.virtual_pipeline_model_parallel_size"
# the keys the rules read; validate passes those whose values are valid
RULE_KEYS = ("training.device", EP_KEY, ETP_KEY, "moe.ep_exchange", "moe.num_experts", "moe.backend",
             "training.recompute_granularity", VPP_KEY)
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
    vpp = get(VPP_KEY)
    if vpp is not None and vpp > 1:
        # two H100s, fp32, pipeline 2 x virtual 2: from the first replayed step the grad norm differed
        # from the eager run's by 0.5-1.4 % (dense and MoE alike), where the plain pipeline matches
        found.append((f"the interleaved pipeline ({VPP_KEY} = {vpp}) has not been shown to capture correctly",
                      f"set it to null {STRICT_FIX}"))
    recompute = get("training.recompute_granularity")
    if recompute is not None:
        # full: megatron-core's per-layer graphs take it only inside a whole-iteration graph;
        # selective: they capture each layer's backward with torch.autograd.grad, which megatron's
        # reentrant checkpoint of the attention core refuses ("Checkpointing is not compatible with .grad()")
        found.append((f"activation recompute (training.recompute_granularity: {recompute}) re-runs layer parts "
                      "inside backward through megatron's reentrant checkpoint, which per-layer graphs cannot capture",
                      f"set it to null (moe.memory_optimized: true recomputes the experts' activation and is "
                      f"captured) {STRICT_FIX}"))
    if (get("moe.num_experts") or 0) > 0 and get("moe.backend") == "reference":
        found.append(("moe.backend: reference reads the expert counts on the host",
                      f"use sparse, grouped or auto {STRICT_FIX}"))
    return found
