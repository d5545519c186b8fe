"""Our dense GPT as transformers' GPT2LMHeadModel: config.json fields and weights.

GPT-2's Conv1D layers store weights as [in, out], the transpose of torch.nn.Linear (and of
megatron's linears); its c_attn holds all queries, then all keys, then all values. Missing biases
(model.add_bias_linear=false) are exported as zeros.
"""
from __future__ import annotations

from typing import Dict

import torch

from megatron_dmoe.export.weights import split_qkv


def gpt2_config(cfg, tc, vocab_size: int, eod: int) -> dict:
    """cfg: the run config; tc: the model's TransformerConfig; vocab_size: padded."""
    m = cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": m.max_position_embeddings,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn_hidden_size,
        "activation_function": "gelu",  # the exact (erf) GELU, as megatron's F.gelu; not gelu_new
        "layer_norm_epsilon": tc.layernorm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "use_cache": True,
    }


def gpt2_weights(state: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    m = cfg.model
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads

    def bias(name: str, size: int) -> torch.Tensor:
        b = state.get(name)
        return b if b is not None else torch.zeros(size, dtype=state["embedding.word_embeddings.weight"].dtype)

    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = state[src + "self_attention.linear_qkv.weight"]
        qkv_bias = bias(src + "self_attention.linear_qkv.bias", qkv.shape[0])
        h = m.hidden_size
        out.update({
            dst + "ln_1.weight": state[src + "input_layernorm.weight"],
            dst + "ln_1.bias": state[src + "input_layernorm.bias"],
            dst + "attn.c_attn.weight": torch.cat(split_qkv(qkv, heads, heads, head_dim)).t(),
            dst + "attn.c_attn.bias": torch.cat(split_qkv(qkv_bias, heads, heads, head_dim)),
            dst + "attn.c_proj.weight": state[src + "self_attention.linear_proj.weight"].t(),
            dst + "attn.c_proj.bias": bias(src + "self_attention.linear_proj.bias", h),
            dst + "ln_2.weight": state[src + "pre_mlp_layernorm.weight"],
            dst + "ln_2.bias": state[src + "pre_mlp_layernorm.bias"],
            dst + "mlp.c_fc.weight": state[src + "mlp.linear_fc1.weight"].t(),
            dst + "mlp.c_fc.bias": bias(src + "mlp.linear_fc1.bias", m.ffn_hidden_size),
            dst + "mlp.c_proj.weight": state[src + "mlp.linear_fc2.weight"].t(),
            dst + "mlp.c_proj.bias": bias(src + "mlp.linear_fc2.bias", h),
        })
    return out
