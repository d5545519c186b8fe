"""Which transformers architecture, if any, computes exactly what a run's model computes.

Our dense GPT (LayerNorm, learned positions, GELU, multi-head attention) is GPT-2; a model whose
every layer is an MoE of SwiGLU experts with RMSNorm, RoPE, no linear biases and softmax top-k
routing renormalised over the chosen experts is Mixtral. Everything else is refused with the
settings that have no equivalent, so an export never silently changes what the model computes.
"""
from __future__ import annotations

from typing import List

from megatron_dmoe.config import RunConfig
from megatron_dmoe.inference.errors import UsageError

GPT2 = "gpt2"
MIXTRAL = "mixtral"


def _gpt2_mismatches(cfg: RunConfig) -> List[str]:
    m = cfg.model
    out = []
    if cfg.moe.num_experts:
        out.append(f"moe.num_experts={cfg.moe.num_experts} (GPT-2 is dense: 0)")
    if m.normalization != "LayerNorm":
        out.append(f"model.normalization={m.normalization} (GPT-2: LayerNorm)")
    if m.position_embedding_type != "learned_absolute":
        out.append(f"model.position_embedding_type={m.position_embedding_type} (GPT-2: learned_absolute)")
    if m.activation != "gelu":
        out.append(f"model.activation={m.activation} (GPT-2: gelu)")
    if m.num_query_groups != m.num_attention_heads:
        out.append(f"model.num_query_groups={m.num_query_groups} (GPT-2: multi-head attention, "
                   f"{m.num_attention_heads})")
    return out


def _mixtral_mismatches(cfg: RunConfig) -> List[str]:
    m, moe = cfg.model, cfg.moe
    out = []
    if not moe.num_experts:
        out.append("moe.num_experts=0 (Mixtral: an MoE in every layer)")
    else:
        if moe.layer_freq != 1:
            out.append(f"moe.layer_freq={moe.layer_freq} (Mixtral: an MoE in every layer, 1)")
        if moe.first_dense_layers:
            out.append(f"moe.first_dense_layers={moe.first_dense_layers} (Mixtral: an MoE in every layer, 0)")
        if moe.router_score_function != "softmax":
            out.append(f"moe.router_score_function={moe.router_score_function} (Mixtral: softmax)")
        # Mixtral: softmax over all experts, top-k, weights renormalised to sum 1. A softmax over
        # the k chosen logits (pre_softmax false) is the same weights.
        elif moe.router_pre_softmax and not moe.router_renormalize:
            out.append("moe.router_pre_softmax=true with moe.router_renormalize=false (Mixtral renormalises "
                       "the top-k weights: set router_renormalize=true, top_k > 1)")
        if moe.router_topk_scaling_factor != 1.0:
            out.append(f"moe.router_topk_scaling_factor={moe.router_topk_scaling_factor} (Mixtral: 1.0)")
        if moe.router_enable_expert_bias:
            out.append("moe.router_enable_expert_bias=true (Mixtral has no selection bias)")
        if moe.expert_capacity_factor is not None:
            out.append(f"moe.expert_capacity_factor={moe.expert_capacity_factor} (Mixtral never drops tokens: null)")
    if m.activation != "swiglu":
        out.append(f"model.activation={m.activation} (Mixtral: swiglu)")
    if m.normalization != "RMSNorm":
        out.append(f"model.normalization={m.normalization} (Mixtral: RMSNorm)")
    if m.position_embedding_type != "rope":
        out.append(f"model.position_embedding_type={m.position_embedding_type} (Mixtral: rope)")
    if m.add_bias_linear:
        out.append("model.add_bias_linear=true (Mixtral's linear layers have no biases: false)")
    return out


def hf_architecture(cfg: RunConfig) -> str:
    """GPT2 or MIXTRAL for a run config (resolved); UsageError naming what has no equivalent."""
    gpt2, mixtral = _gpt2_mismatches(cfg), _mixtral_mismatches(cfg)
    if not gpt2:
        return GPT2
    if not mixtral:
        return MIXTRAL
    closest, reasons = ("GPT-2", gpt2) if cfg.moe.num_experts == 0 else ("Mixtral", mixtral)
    raise UsageError(f"this model has no transformers equivalent; as {closest} these settings differ: "
                     + "; ".join(reasons))
