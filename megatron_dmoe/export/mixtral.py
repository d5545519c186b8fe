"""Our SwiGLU / RMSNorm / RoPE dMoE as transformers' MixtralForCausalLM: config.json and weights.

Weights use Mixtral's published layout (block_sparse_moe.gate, block_sparse_moe.experts.N.w1/w2/w3),
which every transformers version with Mixtral loads. Expert e of ours computes
silu(x w1[e]^T) * (x v1[e]^T) @ w2[e] with all three stored [ffn, hidden]: Mixtral's w1 (gate) is
our w1, its w3 (up) our v1, its w2 (down, [hidden, ffn]) our w2 transposed. megatron's RoPE rotates
halves (not interleaved pairs), as transformers' does, so queries and keys need no permutation.
"""
from __future__ import annotations

from typing import Dict

import torch

from megatron_dmoe.export.weights import split_qkv


def mixtral_config(cfg, tc, vocab_size: int, eod: int, bos: int) -> dict:
    m, moe = cfg.model, cfg.moe
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
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
        "rope_theta": float(m.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos,
        "eos_token_id": eod,
        "use_cache": True,
    }


def mixtral_weights(state: Dict[str, torch.Tensor], cfg, head_dim: int) -> Dict[str, torch.Tensor]:
    m = cfg.model
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(state[src + "self_attention.linear_qkv.weight"], m.num_attention_heads,
                            m.num_query_groups, head_dim)
        out.update({
            dst + "input_layernorm.weight": state[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": state[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": state[src + "pre_mlp_layernorm.weight"],
            dst + "block_sparse_moe.gate.weight": state[src + "mlp.router.weight"],
        })
        w1, v1, w2 = (state[src + f"mlp.experts.{n}"] for n in ("w1", "v1", "w2"))
        for e in range(w1.shape[0]):
            expert = dst + f"block_sparse_moe.experts.{e}."
            out[expert + "w1.weight"] = w1[e]
            out[expert + "w3.weight"] = v1[e]
            out[expert + "w2.weight"] = w2[e].t()
    return out
