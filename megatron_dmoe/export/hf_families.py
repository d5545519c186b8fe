"""The transformers families our SwiGLU / RMSNorm / RoPE models are: the dMoEs Mixtral, Qwen3-MoE,
OLMoE and Qwen2-MoE, and the dense Llama and Qwen3.

All are the same decoder (pre-norm RMSNorm, grouped-query attention with RoPE on rotated halves,
SwiGLU MLPs) and differ in a few places:
- the MLP: a dense one (Llama, Qwen3: model.ffn_hidden_size), or softmax top-k routing over SwiGLU
  experts, with a shared expert behind a sigmoid gate for Qwen2-MoE (moe.shared_expert_ffn_hidden_size
  with moe.shared_expert_gate);
- the query/key norm: none (Mixtral, Llama, Qwen2-MoE), an RMSNorm per head (Qwen3-MoE, Qwen3:
  model.qk_layernorm with qk_layernorm_scope head, megatron-core's own), or one over the whole
  projection (OLMoE: scope projection);
- biases: none, or on the queries, keys and values only where config.json's qkv_bias says
  (Qwen2-MoE: model.add_qkv_bias);
- the routing weights: renormalised over the chosen experts always (Mixtral), or as config.json's
  norm_topk_prob says (moe.router_renormalize);
- the weights' names (hf_weights.py) and config.json's field names (`hf_config` here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    key: str  # hf_architecture.py's name for it
    architecture: str  # config.json's architectures[0]
    model_type: str
    title: str  # as people write it
    moe: Optional[str]  # the MoE block's module name in each layer; None: a dense model
    experts: Tuple[str, str, str]  # the expert (or dense MLP) projections' names: gate, up, down
    qk_norm: Optional[str]  # model.qk_layernorm_scope, None: no query/key norm
    experts_field: Optional[str]  # config.json's number of experts
    shared_expert: bool = False  # a shared expert behind a sigmoid gate (mlp.shared_expert, shared_expert_gate)
    qkv_bias_field: Optional[str] = None  # config.json's switch for query/key/value biases


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral", "Mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
                 None, "num_local_experts")
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE", "mlp", MLP_NAMES, "head",
                   "num_experts")
OLMOE = Family("olmoe", "OlmoeForCausalLM", "olmoe", "OLMoE", "mlp", MLP_NAMES, "projection", "num_experts")
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2-MoE", "mlp", MLP_NAMES, None,
                   "num_experts", shared_expert=True, qkv_bias_field="qkv_bias")
LLAMA = Family("llama", "LlamaForCausalLM", "llama", "Llama", None, MLP_NAMES, None, None)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "qwen3", "Qwen3", None, MLP_NAMES, "head", None)
FAMILIES: Tuple[Family, ...] = (MIXTRAL, QWEN3_MOE, OLMOE, QWEN2_MOE, LLAMA, QWEN3)
BY_KEY: Dict[str, Family] = {f.key: f for f in FAMILIES}
BY_ARCHITECTURE: Dict[str, Family] = {f.architecture: f for f in FAMILIES}


def hf_config(family: Family, cfg, tc, vocab_size: int, eod: int, bos: int) -> dict:
    """config.json of a run (resolved config `cfg`, its model's TransformerConfig `tc`) as `family`."""
    m, moe = cfg.model, cfg.moe
    rope = float(m.rotary_base)
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": moe.ffn_hidden_size if family.moe else tc.ffn_hidden_size,
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
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos,
        "eos_token_id": eod,
        "pad_token_id": None,
        "use_cache": True,
    }
    if family.moe:
        out.update({family.experts_field: moe.num_experts, "num_experts_per_tok": moe.top_k,
                    "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False})
    # softmax over the k chosen logits (router_pre_softmax false) gives the renormalised weights
    norm_topk = bool(moe.router_renormalize or not moe.router_pre_softmax)
    if family is MIXTRAL:
        out.update(sliding_window=None, router_jitter_noise=moe.input_jitter_eps or 0.0)
    elif family is QWEN3_MOE:
        out.update(intermediate_size=tc.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
                   norm_topk_prob=norm_topk, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                   use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    elif family is QWEN2_MOE:
        out.update(intermediate_size=tc.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
                   shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, norm_topk_prob=norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=m.add_qkv_bias, use_sliding_window=False,
                   sliding_window=None, max_window_layers=m.num_layers)
    elif family is OLMOE:
        out.update(norm_topk_prob=norm_topk, attention_bias=False, clip_qkv=None)
    elif family is LLAMA:
        out.update(attention_bias=False, mlp_bias=False)
    else:  # QWEN3
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=m.num_layers)
    return out
