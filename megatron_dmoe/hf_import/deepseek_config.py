"""A transformers config.json of DeepSeek-V2 or DeepSeek-V3 as our config keys (multi-latent
attention, dense first layers, shared experts, group-limited routing, V3's sigmoid scores with a
selection bias), or one line naming the field that has no equivalent here. See export/deepseek.py
for what the two compute."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

from megatron_dmoe.export.deepseek import DEEPSEEK_V2, LATENT_NORM_EPS, V3_GROUP_BEST
from megatron_dmoe.export.hf_families import Family
from megatron_dmoe.inference.errors import UsageError

_POSITIVE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "moe_intermediate_size",
             "vocab_size", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _refuse(path: Path, field: str, value: Any, what: str) -> None:
    raise UsageError(f"{path}: {field}={json.dumps(value)} is not supported ({what})")


def _rope_keys(config: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """model.* keys of the rotary embedding: default RoPE or YaRN, as transformers reads them."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    params = {**{k: v for k, v in legacy.items() if k != "type"}, **params}
    kind = params.get("rope_type", legacy.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not float(theta).is_integer() or theta <= 0:
        _refuse(path, "rope_theta", theta, "model.rotary_base takes a positive integer")
    keys = {"model.rotary_base": int(theta), "model.rope_type": "rope", "model.rotary_scaling_factor": 1.0}
    if kind == "default":
        return keys
    if kind != "yarn":
        _refuse(path, "rope_parameters.rope_type", kind, "default or yarn only")
    if params.get("attention_factor") is not None:
        _refuse(path, "rope_parameters.attention_factor", params["attention_factor"],
                "megatron-core derives it from factor, mscale and mscale_all_dim; leave it out")
    if params.get("truncate", True) is not True:
        _refuse(path, "rope_parameters.truncate", params["truncate"], "megatron-core's YaRN rounds its ramp: true")
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        _refuse(path, "rope_parameters.original_max_position_embeddings", original, "a positive integer is needed")
    factor = params.get("factor") or config.get("max_position_embeddings", 4096) / original
    mscale, mscale_all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    if factor > 1 and mscale_all_dim and not mscale:
        # transformers' attention factor then ignores mscale_all_dim; megatron-core's divides by it
        _refuse(path, "rope_parameters.mscale", params.get("mscale"), "give mscale with mscale_all_dim")
    keys.update({"model.rope_type": "yarn", "model.rotary_scaling_factor": float(factor),
                 "model.original_max_position_embeddings": original,
                 "model.beta_fast": float(params.get("beta_fast") or 32),
                 "model.beta_slow": float(params.get("beta_slow") or 1),
                 # without both, transformers' attention factor is 0.1 ln(factor) + 1: mscale 1, mscale_all_dim 0
                 "model.mscale": float(mscale) if mscale_all_dim else 1.0,
                 "model.mscale_all_dim": float(mscale_all_dim)})
    return keys


def _routing_keys(config: Dict[str, Any], family: Family, path: Path) -> Dict[str, Any]:
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    groups, topk_group = config.get("n_group"), config.get("topk_group")
    if family is DEEPSEEK_V2:
        method = config.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            _refuse(path, "topk_method", method, "transformers' DeepSeek-V2 routes greedy or group_limited_greedy")
        if config.get("norm_topk_prob"):
            _refuse(path, "norm_topk_prob", True, "transformers' DeepSeek-V2 never renormalises its weights: false")
        grouped = method == "group_limited_greedy"
        keys = {"moe.router_score_function": "softmax", "moe.router_pre_softmax": True,
                "moe.router_renormalize": False, "moe.router_enable_expert_bias": False,
                "moe.router_group_score": "max"}
    else:
        grouped = groups not in (None, 1)
        if grouped and isinstance(topk_group, int) and topk_group >= 1 and top_k // topk_group != V3_GROUP_BEST:
            _refuse(path, "topk_group", topk_group, f"megatron-core scores a group by its best num_experts_per_tok / "
                    f"topk_group ({top_k // topk_group}); DeepSeek-V3 by its best {V3_GROUP_BEST}")
        keys = {"moe.router_score_function": "sigmoid", "moe.router_pre_softmax": False,
                "moe.router_renormalize": bool(config.get("norm_topk_prob", True)),
                "moe.router_enable_expert_bias": True, "moe.router_group_score": "sum"}
    if grouped:
        for field, value in (("n_group", groups), ("topk_group", topk_group)):
            if not isinstance(value, int) or value < 1:
                _refuse(path, field, value, "a positive integer is needed for group-limited routing")
        if experts % groups or topk_group > groups:
            _refuse(path, "n_group", groups, f"n_routed_experts ({experts}) in equal groups, topk_group of them")
    keys.update({"moe.router_num_groups": groups if grouped else None,
                 "moe.router_group_topk": topk_group if grouped else None})
    return keys


def _refuse_unsupported(config: Dict[str, Any], path: Path) -> None:
    if config.get("quantization_config"):  # DeepSeek-V3's own release: fp8 weights with block scales
        _refuse(path, "quantization_config", config["quantization_config"].get("quant_method", True),
                "quantized weights; dequantize them (bf16) first")
    if config.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", config.get("hidden_act"), "the MLPs are SwiGLU: silu only")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            _refuse(path, field, True, "linear layers without biases only: false")
    for field in _POSITIVE:
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _refuse(path, field, value, "a positive integer is needed")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        _refuse(path, "num_key_value_heads", config["num_key_value_heads"],
                f"multi-latent attention expands a key and a value for every head: {heads}")
    if config.get("q_lora_rank") is not None and (not isinstance(config["q_lora_rank"], int)
                                                  or config["q_lora_rank"] < 1):
        _refuse(path, "q_lora_rank", config["q_lora_rank"], "a positive integer or null")
    if config.get("moe_layer_freq", 1) != 1:
        _refuse(path, "moe_layer_freq", config["moe_layer_freq"], "transformers builds an MoE in every layer after "
                "the first_k_dense_replace dense ones: 1")
    if config.get("rope_interleave", True) is not True:
        _refuse(path, "rope_interleave", config["rope_interleave"], "megatron-core's multi-latent attention "
                "rotates DeepSeek's interleaved pairs: true")
    eps = config.get("rms_norm_eps", LATENT_NORM_EPS)
    if eps != LATENT_NORM_EPS:
        _refuse(path, "rms_norm_eps", eps, f"transformers norms the attention latents with {LATENT_NORM_EPS} and "
                "megatron-core with the model's epsilon: they must be equal")
    dense = config.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense <= config["num_hidden_layers"]:
        _refuse(path, "first_k_dense_replace", dense, "0 to num_hidden_layers")


def model_keys(config: Dict[str, Any], family: Family, path: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(fixed, defaults) for a DeepSeek-V2/V3 config.json (see hf_config.model_keys)."""
    _refuse_unsupported(config, path)
    fixed = {
        "model.num_layers": config["num_hidden_layers"],
        "model.hidden_size": config["hidden_size"],
        "model.num_attention_heads": config["num_attention_heads"],
        "model.ffn_hidden_size": config["intermediate_size"],
        "model.max_position_embeddings": config.get("max_position_embeddings", 4096),
        "model.vocab_size": config["vocab_size"],
        "model.make_vocab_size_divisible_by": 1,
        "model.position_embedding_type": "rope",
        "model.normalization": "RMSNorm",
        "model.norm_epsilon": LATENT_NORM_EPS,
        "model.activation": "swiglu",
        "model.add_bias_linear": False,
        "model.untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "model.qk_layernorm": True,  # the latents' norms
        "model.multi_latent_attention": True,
        "model.q_lora_rank": config.get("q_lora_rank"),
        "model.kv_lora_rank": config["kv_lora_rank"],
        "model.qk_head_dim": config["qk_nope_head_dim"],
        "model.qk_pos_emb_head_dim": config["qk_rope_head_dim"],
        "model.v_head_dim": config["v_head_dim"],
        **_rope_keys(config, path),
        "moe.num_experts": config["n_routed_experts"],
        "moe.top_k": config["num_experts_per_tok"],
        "moe.ffn_hidden_size": config["moe_intermediate_size"],
        "moe.layer_freq": 1,
        "moe.first_dense_layers": config.get("first_k_dense_replace", 0),
        "moe.router_topk_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        **_routing_keys(config, family, path),
        "moe.expert_capacity_factor": None,
        "moe.shared_expert_ffn_hidden_size": config["moe_intermediate_size"] * config["n_shared_experts"],
        "moe.shared_expert_gate": False,
        "moe.input_jitter_eps": None,
    }
    defaults = {
        "model.init_method_std": config.get("initializer_range", 0.02),
        "model.attention_dropout": config.get("attention_dropout", 0.0),
        # DeepSeek's own config.json (transformers keeps no training settings): a sequence-wise loss
        "moe.aux_loss_coeff": config.get("aux_loss_alpha", 0.001),
        "moe.aux_loss_type": "sequence" if config.get("seq_aux", True) else "micro_batch",
    }
    return fixed, defaults
