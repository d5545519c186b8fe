"""Which transformers architecture, if any, computes exactly what a run's model computes.

Our dense GPT (LayerNorm, learned positions, GELU, multi-head attention) is GPT-2. A model with
RMSNorm, RoPE, SwiGLU and no linear biases is one of the families of hf_families.py: dense, Llama
(no query/key norm) or Qwen3 (one per head); with an MoE of softmax top-k routing in every layer,
Mixtral without a query/key norm (its routing weights renormalised over the chosen experts),
Qwen3-MoE with a per-head one, OLMoE with one over the whole projection, and Qwen2-MoE with a gated
shared expert (and query/key/value biases or none). A model with multi-latent attention is
DeepSeek-V2 (softmax routing) or DeepSeek-V3 (sigmoid routing with an expert bias), deepseek.py, or
nothing: neither the stock families nor our modeling file compute that attention. Every other model
(the quick-start and zoo GPT MoEs: LayerNorm, GELU experts, learned positions, biases) is
DmoeGptForCausalLM, whose modeling file the export ships (dmoe_gpt.py); what that cannot compute
either (token dropping) is refused with the settings at fault, so an export never silently changes
what the model computes.
"""
from __future__ import annotations

from typing import List

from megatron_dmoe.config import RunConfig
from megatron_dmoe.export import deepseek, hf_families as families
from megatron_dmoe.export.dmoe_gpt import dmoe_gpt_mismatches
from megatron_dmoe.inference.errors import UsageError

GPT2 = "gpt2"
MIXTRAL = families.MIXTRAL.key
QWEN3_MOE = families.QWEN3_MOE.key
OLMOE = families.OLMOE.key
QWEN2_MOE = families.QWEN2_MOE.key
LLAMA = families.LLAMA.key
QWEN3 = families.QWEN3.key
DEEPSEEK_V2 = deepseek.DEEPSEEK_V2.key
DEEPSEEK_V3 = deepseek.DEEPSEEK_V3.key
DMOE_GPT = "dmoe_gpt"  # ours, with its modeling file (trust_remote_code)


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
    if m.kv_channels not in (None, m.hidden_size // m.num_attention_heads):
        out.append(f"model.kv_channels={m.kv_channels} (GPT-2: hidden_size / num_attention_heads)")
    if m.qk_layernorm:
        out.append("model.qk_layernorm=true (GPT-2 has no query/key norm)")
    if m.multi_latent_attention:
        out.append("model.multi_latent_attention=true (GPT-2: multi-head attention)")
    return out


def _family_mismatches(cfg: RunConfig, family: families.Family) -> List[str]:
    m, moe = cfg.model, cfg.moe
    name = family.title
    out = []
    if family.moe is None:
        if moe.num_experts:
            out.append(f"moe.num_experts={moe.num_experts} ({name} is dense: 0)")
    elif not moe.num_experts:
        out.append(f"moe.num_experts=0 ({name}: an MoE in every layer)")
    else:
        if moe.layer_freq != 1:
            out.append(f"moe.layer_freq={moe.layer_freq} ({name}: an MoE in every layer, 1)")
        if moe.first_dense_layers:
            out.append(f"moe.first_dense_layers={moe.first_dense_layers} ({name}: an MoE in every layer, 0)")
        if moe.router_score_function != "softmax":
            out.append(f"moe.router_score_function={moe.router_score_function} ({name}: softmax)")
        # Mixtral: softmax over all experts, top-k, weights renormalised to sum 1. A softmax over
        # the k chosen logits (pre_softmax false) is the same weights. The others renormalise or
        # not (norm_topk_prob).
        elif family is families.MIXTRAL and moe.router_pre_softmax and not moe.router_renormalize:
            out.append("moe.router_pre_softmax=true with moe.router_renormalize=false (Mixtral renormalises "
                       "the top-k weights: set router_renormalize=true, top_k > 1)")
        if moe.router_topk_scaling_factor != 1.0:
            out.append(f"moe.router_topk_scaling_factor={moe.router_topk_scaling_factor} ({name}: 1.0)")
        if moe.router_enable_expert_bias:
            out.append(f"moe.router_enable_expert_bias=true ({name} has no selection bias)")
        if moe.router_num_groups:
            out.append(f"moe.router_num_groups={moe.router_num_groups} ({name} routes over all experts: null)")
        if moe.expert_capacity_factor is not None:
            out.append(f"moe.expert_capacity_factor={moe.expert_capacity_factor} ({name} never drops tokens: null)")
        if family.shared_expert and not (moe.shared_expert_ffn_hidden_size and moe.shared_expert_gate):
            out.append(f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size} with "
                       f"moe.shared_expert_gate={str(moe.shared_expert_gate).lower()} ({name}: a shared expert "
                       "behind a gate)")
        elif not family.shared_expert and moe.shared_expert_ffn_hidden_size:
            out.append(f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size} "
                       f"({name} has no shared experts: 0)")
    if m.multi_latent_attention:
        out.append(f"model.multi_latent_attention=true ({name}: grouped-query attention)")
    if m.activation != "swiglu":
        out.append(f"model.activation={m.activation} ({name}: swiglu)")
    if m.normalization != "RMSNorm":
        out.append(f"model.normalization={m.normalization} ({name}: RMSNorm)")
    if m.position_embedding_type != "rope":
        out.append(f"model.position_embedding_type={m.position_embedding_type} ({name}: rope)")
    if m.rotary_percent != 1.0:
        out.append(f"model.rotary_percent={m.rotary_percent:g} ({name} rotates whole heads: 1.0)")
    if m.add_bias_linear:
        out.append(f"model.add_bias_linear=true ({name}'s linear layers have no biases: false)")
    if m.add_qkv_bias and not family.qkv_bias_field:
        out.append(f"model.add_qkv_bias=true ({name} has no query/key/value biases: false)")
    scope = m.qk_layernorm_scope if m.qk_layernorm else None
    if scope != family.qk_norm:
        has = {None: "no query/key norm", "head": "a query/key norm per head",
               "projection": "a query/key norm over the projection"}[family.qk_norm]
        out.append(f"model.qk_layernorm={str(m.qk_layernorm).lower()}"
                   + (f" with qk_layernorm_scope={scope}" if scope else "") + f" ({name} has {has})")
    if family is families.OLMOE and m.kv_channels not in (None, m.hidden_size // m.num_attention_heads):
        out.append(f"model.kv_channels={m.kv_channels} (OLMoE's heads are hidden_size / num_attention_heads "
                   f"wide: {m.hidden_size // m.num_attention_heads})")
    return out


def _closest_stock(cfg: RunConfig):
    """(the stock architecture nearest the run's model, the settings that differ from it): the one
    with the fewest, dense ones for a dense model, MoE ones for an MoE."""
    dense = cfg.moe.num_experts == 0
    candidates = [("GPT-2", _gpt2_mismatches(cfg))] if dense else []
    candidates += [(f.title, _family_mismatches(cfg, f)) for f in families.FAMILIES if (f.moe is None) == dense]
    return min(candidates, key=lambda c: len(c[1]))


def hf_architecture(cfg: RunConfig) -> str:
    """GPT2, the key of a family of hf_families.py, DEEPSEEK_V2 or DEEPSEEK_V3 for a run config
    (resolved) where one computes its model, else DMOE_GPT; UsageError naming what none computes.
    A multi-latent-attention model is DeepSeek's of its routing scores (deepseek.py) or refused."""
    if cfg.model.multi_latent_attention:
        family = deepseek.deepseek_family(cfg)
        reasons = deepseek.mismatches(cfg, family)
        if not reasons:
            return family.key
        raise UsageError(f"this model has no transformers equivalent; as {family.title} these settings differ: "
                         + "; ".join(reasons))
    if not _gpt2_mismatches(cfg):
        return GPT2
    for family in families.FAMILIES:
        if not _family_mismatches(cfg, family):
            return family.key
    own = dmoe_gpt_mismatches(cfg)
    if not own:
        return DMOE_GPT
    raise UsageError("this model has no transformers equivalent: " + "; ".join(own))


def why_not_stock(cfg: RunConfig) -> str:
    """For a DMOE_GPT model: the stock architecture nearest it and the settings that differ."""
    closest, reasons = _closest_stock(cfg)
    return f"as {closest} these settings differ: " + "; ".join(reasons)
