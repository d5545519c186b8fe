"""moe.*: the MoE layer's rules (config/moe_rules.py) on the values the layer will get, and the
machine its kernels need."""
from __future__ import annotations

import os

from megatron_dmoe.parallel.layout_rules import EP_KEY, ETP_KEY, ffn_shards_per_expert

from .. import moe_rules
from ..moe_layers import moe_layer_pattern
from ..moe_settings import OPTION_KEYS
from .state import CheckState


def check(state: CheckState) -> None:
    """The MoE layer's rules (config/moe_rules.py) on the values the layer will get."""
    v, ok = state.v, state.ok
    if not ok("moe.num_experts") or v("moe.num_experts") == 0:
        return  # a dense model: the router keys are unused
    if ok("moe.layer_freq", "moe.first_dense_layers", "model.num_layers") \
            and not any(moe_layer_pattern(v("model.num_layers"), v("moe.layer_freq"), v("moe.first_dense_layers"))):
        layers, freq = v("model.num_layers"), v("moe.layer_freq")
        state.problem("moe.first_dense_layers", f"{v('moe.first_dense_layers')} leaves no MoE layer among the "
                      f"model's {layers} (MoE layers are every moe.layer_freq-th, {freq}, from layer 0); use "
                      f"at most {max(i for i in range(layers) if i % freq == 0)}, or moe.num_experts 0 for a "
                      f"dense model")
    values = {field: v(key) for field, key in OPTION_KEYS.items() if ok(key)}
    sparse = ok("moe.backend", "training.device") and _sparse_backend(state)
    precision_ok = ok("training.bf16", "training.fp16")
    element_bytes = (2 if v("training.bf16") or v("training.fp16") else 4) if precision_ok else None
    for field, message in moe_rules.option_problems(
            values, OPTION_KEYS.get, sparse=sparse, ffn_shards=_ffn_shards(state, v("moe.num_experts")),
            element_bytes=element_bytes):
        state.problem(OPTION_KEYS[field], message)
    if ok("moe.backend", "training.device") and v("moe.backend") == "sparse" and not _on_cuda(state) \
            and os.environ.get("TRITON_INTERPRET") != "1":
        state.problem("moe.backend", "sparse needs CUDA here (on CPU the block-sparse kernels run only "
                      "under Triton's interpreter, TRITON_INTERPRET=1, slowly); use auto, reference or grouped")
    if ok("moe.router_impl", "training.device") and v("moe.router_impl") == "fused" and not _on_cuda(state) \
            and os.environ.get("TRITON_INTERPRET") != "1":
        state.problem("moe.router_impl", "fused needs CUDA here (on CPU its Triton kernels run only under "
                      "Triton's interpreter, TRITON_INTERPRET=1); use auto or torch")


def _on_cuda(state: CheckState) -> bool:
    device = state.v("training.device")
    return device == "cuda" or (device == "auto" and state.env.cuda)


def _ffn_shards(state: CheckState, experts: int) -> int:
    """Ranks each expert's FFN is split over: the expert-tensor-parallel size, times the
    expert-parallel ranks per expert when EP is a multiple of the experts."""
    ep = state.v(EP_KEY) if state.ok(EP_KEY) else 1
    etp = state.v(ETP_KEY) if state.ok(ETP_KEY) else 1
    if experts and ep > experts and ep % experts:
        ep = 1  # reported elsewhere
    return ffn_shards_per_expert(experts, ep, etp)


def _sparse_backend(state: CheckState) -> bool:
    backend = state.v("moe.backend")
    if backend == "sparse":
        return True
    if backend != "auto" or not state.ok("training.device"):
        return False
    # auto picks the sparse kernels on CUDA
    device = state.v("training.device")
    return device == "cuda" or (device == "auto" and state.env.cuda)
