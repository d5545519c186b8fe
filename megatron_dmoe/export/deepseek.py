"""transformers' DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) as our
multi-latent-attention dMoE: which runs are one (`mismatches`) and their config.json (`hf_config`).
Their weights: deepseek_weights.py; reading a config.json: hf_import/deepseek_config.py.

Both are pre-norm RMSNorm decoders with multi-latent attention (latent norms at epsilon 1e-6,
whatever rms_norm_eps says), first_k_dense_replace dense SwiGLU layers, then MoE layers of SwiGLU
experts with shared experts, whose weights are multiplied by routed_scaling_factor. They route
differently, as transformers implements them:
- DeepSeek-V2: softmax over all experts, top-k of those probabilities, never renormalised
  (transformers ignores norm_topk_prob); group_limited_greedy keeps each token's topk_group best of
  n_group groups, a group scored by its best probability (moe.router_group_score max);
- DeepSeek-V3: sigmoid scores; the choice adds the selection bias (the router's expert_bias) and
  keeps the topk_group best groups, each scored by the sum of its best two (moe.router_group_score
  sum with top_k / router_group_topk = 2); weights are the chosen scores, renormalised as
  norm_topk_prob says.
"""
from __future__ import annotations

from typing import List

from megatron_dmoe.export.hf_families import MLP_NAMES, Family

DEEPSEEK_V2 = Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek_v2", "DeepSeek-V2", "mlp", MLP_NAMES, None,
                     "n_routed_experts")
DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", "DeepSeek-V3", "mlp", MLP_NAMES, None,
                     "n_routed_experts")
DEEPSEEK_FAMILIES = (DEEPSEEK_V2, DEEPSEEK_V3)
# transformers' DeepSeek latent norms (q_a_layernorm, kv_a_layernorm) are made with this epsilon
LATENT_NORM_EPS = 1e-6
# DeepSeek-V3 scores a group by the sum of its best two scores (transformers' topk(2))
V3_GROUP_BEST = 2


def deepseek_family(cfg) -> Family:
    """DeepSeek-V3 for sigmoid routing scores, DeepSeek-V2 for softmax."""
    return DEEPSEEK_V3 if cfg.moe.router_score_function == "sigmoid" else DEEPSEEK_V2


def _yarn_mismatches(m) -> List[str]:
    out = []
    scaled = m.rotary_scaling_factor > 1
    if m.rope_type == "rope" and scaled and m.mscale_all_dim:
        out.append(f"model.rotary_scaling_factor={m.rotary_scaling_factor} with model.mscale_all_dim="
                   f"{m.mscale_all_dim} and rope_type rope (megatron-core scales the attention; DeepSeek only "
                   "with yarn)")
    if m.rope_type == "yarn" and scaled and not m.mscale and m.mscale_all_dim:
        out.append("model.mscale=0 with model.mscale_all_dim set (transformers' YaRN then ignores both for its "
                   "attention factor)")
    return out


def mismatches(cfg, family: Family) -> List[str]:
    """The settings of a multi-latent-attention run that `family` cannot compute; empty when it can."""
    m, moe = cfg.model, cfg.moe
    name = family.title
    out = []
    if not moe.num_experts:
        return [f"moe.num_experts=0 ({name}: MoE layers after the first dense ones)"]
    if moe.layer_freq != 1:
        out.append(f"moe.layer_freq={moe.layer_freq} ({name}: an MoE in every layer after the first dense ones, 1)")
    if family is DEEPSEEK_V2:
        if not moe.router_pre_softmax or moe.router_renormalize:
            out.append("moe.router_pre_softmax / router_renormalize: DeepSeek-V2 weights by the softmax over all "
                       "experts, not renormalised (router_pre_softmax=true, router_renormalize=false)")
        if moe.router_enable_expert_bias:
            out.append("moe.router_enable_expert_bias=true (DeepSeek-V2 has no selection bias)")
        if moe.router_num_groups is not None and moe.router_group_score != "max":
            out.append(f"moe.router_group_score={moe.router_group_score} (DeepSeek-V2 scores a group by its best "
                       "expert: max)")
    else:
        if not moe.router_enable_expert_bias:
            out.append("moe.router_enable_expert_bias=false (DeepSeek-V3 chooses with a selection bias: true)")
        if moe.router_num_groups is not None and (
                moe.router_group_score != "sum" or moe.top_k // moe.router_group_topk != V3_GROUP_BEST):
            out.append(f"moe.router_group_score={moe.router_group_score} with top_k / router_group_topk = "
                       f"{moe.top_k // moe.router_group_topk} (DeepSeek-V3 scores a group by the sum of its best "
                       f"{V3_GROUP_BEST}: sum, {V3_GROUP_BEST})")
    if moe.input_jitter_eps:
        out.append(f"moe.input_jitter_eps={moe.input_jitter_eps} ({name} has no input jitter: null)")
    if moe.expert_capacity_factor is not None:
        out.append(f"moe.expert_capacity_factor={moe.expert_capacity_factor} ({name} never drops tokens: null)")
    shared = moe.shared_expert_ffn_hidden_size
    if not shared or shared % moe.ffn_hidden_size:
        out.append(f"moe.shared_expert_ffn_hidden_size={shared} ({name}: n_shared_experts >= 1 experts of "
                   f"moe.ffn_hidden_size {moe.ffn_hidden_size})")
    if moe.shared_expert_gate:
        out.append(f"moe.shared_expert_gate=true ({name}'s shared experts have no gate)")
    if m.activation != "swiglu":
        out.append(f"model.activation={m.activation} ({name}: swiglu)")
    if m.normalization != "RMSNorm":
        out.append(f"model.normalization={m.normalization} ({name}: RMSNorm)")
    if m.add_bias_linear:
        out.append(f"model.add_bias_linear=true ({name}'s linear layers have no biases: false)")
    if not m.qk_layernorm:
        out.append(f"model.qk_layernorm=false ({name} norms its attention latents: true)")
    if m.norm_epsilon != LATENT_NORM_EPS:
        out.append(f"model.norm_epsilon={m.norm_epsilon} (transformers' {name} norms its latents with "
                   f"{LATENT_NORM_EPS})")
    return out + _yarn_mismatches(m)


def _rope_parameters(m) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=m.rotary_scaling_factor,
                    original_max_position_embeddings=m.original_max_position_embeddings, beta_fast=m.beta_fast,
                    beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
    return rope


def hf_config(family: Family, cfg, vocab_size: int, eod: int, bos: int) -> dict:
    """config.json of a run (resolved config `cfg`, mismatches() empty) as `family`."""
    m, moe = cfg.model, cfg.moe
    groups = moe.router_num_groups is not None
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // moe.ffn_hidden_size,
        "num_experts_per_tok": moe.top_k,
        "first_k_dense_replace": moe.first_dense_layers,
        "routed_scaling_factor": moe.router_topk_scaling_factor,
        "n_group": moe.router_num_groups if groups else 1,
        "topk_group": moe.router_group_topk if groups else 1,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_head_dim,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "rope_parameters": _rope_parameters(m),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": moe.aux_loss_coeff,
        "seq_aux": moe.aux_loss_type == "sequence",
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos,
        "eos_token_id": eod,
        "pad_token_id": None,
        "use_cache": True,
    }
    if family is DEEPSEEK_V2:
        out.update(topk_method="group_limited_greedy" if groups else "greedy", norm_topk_prob=False, mlp_bias=False)
    else:
        # no multi-token-prediction layers are exported
        out.update(norm_topk_prob=bool(moe.router_renormalize), rope_interleave=True, num_nextn_predict_layers=0)
    return out
