"""The transformers MoE families our SwiGLU / RMSNorm / RoPE dMoE is: Mixtral, Qwen3-MoE and OLMoE.

All three are the same decoder (pre-norm RMSNorm, grouped-query attention with RoPE on rotated
halves, no linear biases, softmax top-k routing over SwiGLU experts) and differ in three places:
- the query/key norm: none (Mixtral), an RMSNorm per head (Qwen3-MoE: model.qk_layernorm with
  qk_layernorm_scope head, megatron-core's own), or one over the whole projection (OLMoE: scope
  projection);
- the routing weights: renormalised over the chosen experts always (Mixtral), or as config.json's
  norm_topk_prob says (moe.router_renormalize);
- the weights' names (moe_weights.py) and config.json's field names (`hf_config` here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Family:
    key: str  # hf_architecture.py's name for it
    architecture: str  # config.json's architectures[0]
    model_type: str
    title: str  # as people write it
    moe: str  # the MoE block's module name in each layer
    experts: Tuple[str, str, str]  # the expert projections' names: gate, up, down
    qk_norm: Optional[str]  # model.qk_layernorm_scope, None: no query/key norm
    experts_field: str  # config.json's number of experts


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral", "Mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
                 None, "num_local_experts")
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE", "mlp",
                   ("gate_proj", "up_proj", "down_proj"), "head", "num_experts")
OLMOE = Family("olmoe", "OlmoeForCausalLM", "olmoe", "OLMoE", "mlp", ("gate_proj", "up_proj", "down_proj"),
               "projection", "num_experts")
FAMILIES: Tuple[Family, ...] = (MIXTRAL, QWEN3_MOE, OLMOE)
BY_KEY: Dict[str, Family] = {f.key: f for f in FAMILIES}
BY_ARCHITECTURE: Dict[str, Family] = {f.architecture: f for f in FAMILIES}


def family_of_qk_norm(cfg) -> Family:
    """The family a run's query/key norm (or its absence) points to."""
    scope = cfg.model.qk_layernorm_scope if cfg.model.qk_layernorm else None
    return next(f for f in FAMILIES if f.qk_norm == scope)


def hf_config(family: Family, cfg, tc, vocab_size: int, eod: int, bos: int) -> dict:
    """config.json of a run (resolved config `cfg`, its model's TransformerConfig `tc`) as `family`."""
    m, moe = cfg.model, cfg.moe
    rope = float(m.rotary_base)
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": moe.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": tc.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": tc.layernorm_epsilon,
        "rope_theta": rope,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope},
        "attention_dropout": 0.0,
        family.experts_field: moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos,
        "eos_token_id": eod,
        "pad_token_id": None,
        "use_cache": True,
    }
    # softmax over the k chosen logits (router_pre_softmax false) gives the renormalised weights
    norm_topk = bool(moe.router_renormalize or not moe.router_pre_softmax)
    if family is MIXTRAL:
        out.update(sliding_window=None, router_jitter_noise=moe.input_jitter_eps or 0.0)
    elif family is QWEN3_MOE:
        out.update(intermediate_size=m.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
                   norm_topk_prob=norm_topk, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                   use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    else:
        out.update(norm_topk_prob=norm_topk, attention_bias=False, clip_qkv=None)
    return out
