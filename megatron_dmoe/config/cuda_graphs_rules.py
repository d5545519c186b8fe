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
# the keys the rules read; validate passes those whose values are valid
RULE_KEYS = ("training.device", EP_KEY, ETP_KEY, "moe.ep_exchange", "moe.num_experts", "moe.backend",
             "training.recompute_granularity", "model.attention_dropout", "model.transformer_impl")
STRICT_FIX = "or set training.cuda_graphs: false"
Refusal = Tuple[str, str]  # (why capture is not correct here, what to change to capture)


def capture_refusals(values: Mapping[str, Any], cuda: bool, transformer_engine: bool = False) -> List[Refusal]:
    """Every reason these settings cannot be captured; `values` maps RULE_KEYS to their values (a
    key left out is not checked); `transformer_engine`: whether it is installed (model.transformer_impl:
    auto takes it then). The first two (no CUDA) come alone."""
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
    found += _recompute_refusals(get, transformer_engine)
    if (get("moe.num_experts") or 0) > 0 and get("moe.backend") == "reference":
        found.append(("moe.backend: reference reads the expert counts on the host",
                      f"use sparse, grouped or auto {STRICT_FIX}"))
    return found


def _recompute_refusals(get, transformer_engine: bool) -> List[Refusal]:
    recompute = get("training.recompute_granularity")
    key = "training.recompute_granularity"
    if recompute == "full":
        # megatron-core's per-layer graphs take full recompute only inside a whole-iteration graph
        return [(f"full activation recompute ({key}: full) re-runs whole layers inside backward, which "
                 "per-layer graphs cannot capture",
                 f"set it to selective or null (moe.memory_optimized: true recomputes the experts' "
                 f"activation and is captured) {STRICT_FIX}")]
    if recompute != "selective":
        return []
    found = []
    dropout = get("model.attention_dropout") or 0
    if dropout > 0:
        # the recompute would replay megatron's dropout RNG state inside a graph, which megatron refuses too
        found.append((f"selective recompute ({key}: selective) of attention with dropout "
                      f"(model.attention_dropout = {dropout}) cannot be replayed inside a graph",
                      f"set model.attention_dropout: 0 or {key}: null {STRICT_FIX}"))
    impl = get("model.transformer_impl")
    if impl == "transformer_engine" or (impl == "auto" and transformer_engine):
        # only our SDPA core attention recomputes through a non-reentrant checkpoint (model/attention.py);
        # megatron's reentrant one refuses torch.autograd.grad, with which each layer's backward is captured
        found.append((f"selective recompute ({key}: selective) of Transformer Engine's attention goes through "
                      "megatron's reentrant checkpoint, which per-layer graphs cannot capture",
                      f"set model.transformer_impl: local (its attention recomputes capturably) or {key}: null "
                      f"{STRICT_FIX}"))
    return found
