"""A transformers config.json of a family of hf_families.py (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE,
Llama, Qwen3) or of DeepSeek-V2 / DeepSeek-V3 as our config keys, or one line saying which field has
no equivalent here (DeepSeek's fields: deepseek_config.py).

`model_keys` gives two lists of `key=value` overrides: the ones that fix what the model computes
(its shapes, norms, routing: a user may not set them), and defaults a user may change (training
settings config.json carries, such as the load-balancing loss's coefficient).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from megatron_dmoe.config.moe_settings import BLOCK_SIZES
from megatron_dmoe.export.deepseek import DEEPSEEK_FAMILIES
from megatron_dmoe.export.hf_families import BY_ARCHITECTURE, MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE, Family
from megatron_dmoe.hf_import import deepseek_config
from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.moe.experts.sparse import block_size_for

ARCHITECTURES = {**BY_ARCHITECTURE, **{f.architecture: f for f in DEEPSEEK_FAMILIES}}


def read_hf_config(hf_dir: Path) -> Dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise UsageError(f"{hf_dir} is not a directory; give a transformers model directory (config.json, "
                         "*.safetensors, tokenizer files)")
    if not path.is_file():
        raise UsageError(f"{hf_dir} has no config.json: give a transformers model directory (save_pretrained's)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object")
    return config


def family_of(config: Dict[str, Any], path: Path) -> Family:
    architectures = config.get("architectures") or []
    known = ", ".join(ARCHITECTURES)
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise UsageError(f"{path}: architectures={architectures} is not supported; dmoe-import reads {known}")
    return ARCHITECTURES[architectures[0]]


def _rope(config: Dict[str, Any], path: Path) -> float:
    """rope_theta, with default rotary embeddings only (no scaling, every dimension rotated)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    for field, value in (("rope_parameters.rope_type", params.get("rope_type", "default")),
                         ("rope_scaling", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))):
        if value != "default":
            raise UsageError(f"{path}: {field}={value!r} is not supported (RoPE scaling); only the default "
                             "rotary embedding")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UsageError(f"{path}: partial_rotary_factor={partial} is not supported; only 1.0 (every dimension "
                         "rotated)")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not float(theta).is_integer() or theta <= 0:
        raise UsageError(f"{path}: rope_theta={theta} is not supported: model.rotary_base takes a positive integer")
    return theta


def _experts_field(config: Dict[str, Any], family: Family) -> str:
    """Where config.json gives the number of experts: the family's field, or the other spelling
    (transformers 5 writes Qwen3-MoE's as num_local_experts)."""
    return next((f for f in (family.experts_field, "num_local_experts", "num_experts") if f in config),
                family.experts_field)


def _refuse_unsupported(config: Dict[str, Any], family: Family, path: Path) -> None:
    """One line naming the first config.json field whose value this model cannot compute."""
    def refuse(field: str, what: str) -> None:
        raise UsageError(f"{path}: {field}={json.dumps(config.get(field))} is not supported ({what})")

    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the experts are SwiGLU: silu only")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            refuse(field, "linear layers without biases only: false")
    if family.qkv_bias_field is None and config.get("qkv_bias"):
        refuse("qkv_bias", "query/key/value biases are Qwen2-MoE's here; false only")
    if family is MIXTRAL and config.get("sliding_window") is not None:
        refuse("sliding_window", "sliding-window attention; null only")
    if config.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention; false only")
    if config.get("clip_qkv") is not None:
        refuse("clip_qkv", "clipped queries, keys and values; null only")
    if not family.shared_expert and config.get("shared_expert_intermediate_size"):
        refuse("shared_expert_intermediate_size", "a gated shared expert of another kind; 0 only")
    if family in (QWEN3_MOE, QWEN2_MOE):
        if config.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", "dense MLP layers between the MoE layers; 1 only")
        if config.get("mlp_only_layers"):
            refuse("mlp_only_layers", "dense MLP layers; [] only")
    needed = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
    if family.moe:
        needed += ["num_experts_per_tok", _experts_field(config, family)]
    if family.shared_expert:
        needed.append("shared_expert_intermediate_size")
    for field in needed:
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            refuse(field, "a positive integer is needed")


def model_keys(config: Dict[str, Any], family: Family, path: Path) -> Tuple[List[str], List[str]]:
    """(fixed, defaults): `key=value` overrides for our config; UsageError for what has no equivalent."""
    if family in DEEPSEEK_FAMILIES:
        fixed, defaults = deepseek_config.model_keys(config, family, path)
        return _texts(fixed), _texts({**defaults, **_block_keys(fixed["moe.ffn_hidden_size"])})
    _refuse_unsupported(config, family, path)
    theta = _rope(config, path)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if family.qk_norm == "projection" and (hidden % heads or head_dim != hidden // heads):
        raise UsageError(f"{path}: head_dim={head_dim} with hidden_size={hidden} and num_attention_heads={heads} "
                         "is not supported: OLMoE's query norm spans hidden_size, so heads must be hidden_size / "
                         "num_attention_heads wide")
    ffn = config["moe_intermediate_size"] if family in (QWEN3_MOE, QWEN2_MOE) else config["intermediate_size"]
    vocab = config["vocab_size"]
    # the model's rows are exactly config.json's: padded to a multiple of 1 x the tensor-parallel
    # size, so a checkpoint saved at one TP size loads at another that divides the vocabulary
    divisor = 1
    renormalize = True if family is MIXTRAL else bool(config.get("norm_topk_prob", False))
    fixed = {
        "model.num_layers": config["num_hidden_layers"],
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.num_query_groups": groups,
        "model.kv_channels": head_dim,
        "model.ffn_hidden_size": config["intermediate_size"],
        "model.max_position_embeddings": config.get("max_position_embeddings", 4096),
        "model.vocab_size": vocab,
        "model.make_vocab_size_divisible_by": divisor,
        "model.position_embedding_type": "rope",
        "model.rotary_base": int(theta),
        "model.normalization": "RMSNorm",
        "model.norm_epsilon": float(config.get("rms_norm_eps", 1e-5 if family in (MIXTRAL, OLMOE) else 1e-6)),
        "model.activation": "swiglu",
        "model.add_bias_linear": False,
        "model.add_qkv_bias": bool(config.get(family.qkv_bias_field)) if family.qkv_bias_field else False,
        "model.untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "model.qk_layernorm": family.qk_norm is not None,
        "model.qk_layernorm_scope": family.qk_norm or "head",
    }
    shared = config["shared_expert_intermediate_size"] if family.shared_expert else 0
    if family.moe is None:
        # experts as wide as the dense MLP: what upcycling it (checkpoint.upcycle_from) makes
        fixed.update({"moe.num_experts": 0, "moe.ffn_hidden_size": config["intermediate_size"]})
    else:
        fixed.update({
            "moe.num_experts": config[_experts_field(config, family)],
            "moe.top_k": config["num_experts_per_tok"],
            "moe.ffn_hidden_size": ffn,
            "moe.layer_freq": 1,
            "moe.first_dense_layers": 0,
            "moe.router_score_function": "softmax",
            "moe.router_pre_softmax": True,
            "moe.router_renormalize": renormalize,
            "moe.router_topk_scaling_factor": 1.0,
            "moe.router_enable_expert_bias": False,
            "moe.expert_capacity_factor": None,
            "moe.shared_expert_ffn_hidden_size": shared,
            "moe.shared_expert_gate": family.shared_expert,
        })
    defaults = {
        "model.init_method_std": config.get("initializer_range", 0.02),
        "model.attention_dropout": config.get("attention_dropout", 0.0),
        "moe.aux_loss_coeff": config.get("router_aux_loss_coef", 0.01),
        "moe.input_jitter_eps": config.get("router_jitter_noise") or None,
        **_block_keys(fixed["moe.ffn_hidden_size"]),
    }
    return _texts(fixed), _texts(defaults)


def _block_keys(expert_width: int) -> Dict[str, Any]:
    """The sparse backend's block size for the imported experts' width: the largest that divides
    it (the base config's own block size need not); the grouped backend where none does."""
    block = block_size_for(expert_width, max(BLOCK_SIZES))
    return {"moe.block_size": block} if block else {"moe.backend": "grouped"}


def _texts(values: Dict[str, Any]) -> List[str]:
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]
