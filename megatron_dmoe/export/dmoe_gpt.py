"""Our GPT, dense or MoE, as DmoeGptForCausalLM (modeling_dmoe_gpt.py, shipped with the export and
loaded with trust_remote_code): for the models no stock transformers architecture computes, such
as the quick-start and zoo GPT MoEs (LayerNorm, GELU experts, learned positions, biases).

The modeling file's parameters carry megatron-core's names, so the weights go out as the checkpoint
holds them; config.json lists what the modeling file reads (its DmoeGptConfig).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

from megatron_dmoe.config.moe_layers import moe_layer_pattern

ARCHITECTURE = "DmoeGptForCausalLM"
MODELING_FILE = Path(__file__).with_name("modeling_dmoe_gpt.py")
AUTO_MAP = {"AutoConfig": "modeling_dmoe_gpt.DmoeGptConfig",
            "AutoModelForCausalLM": "modeling_dmoe_gpt.DmoeGptForCausalLM"}


def dmoe_gpt_mismatches(cfg) -> List[str]:
    """The settings the modeling file cannot compute (it routes every token, as training's
    dropless layers do, from the router's own scores)."""
    moe = cfg.moe
    out = []
    if cfg.model.multi_latent_attention:
        out.append("model.multi_latent_attention=true (the modeling file computes the usual attention; "
                   "DeepSeek-V2/V3 compute multi-latent attention)")
    if moe.num_experts and moe.expert_capacity_factor is not None:
        out.append(f"moe.expert_capacity_factor={moe.expert_capacity_factor} (tokens dropped as each batch fills "
                   "the experts: transformers would compute another model; null)")
    if moe.num_experts and moe.router_force_load_balancing:
        out.append("moe.router_force_load_balancing=true (random routing, for speed measurements only)")
    return out


def dmoe_gpt_config(cfg, tc, vocab_size: int, eod: int, bos: int) -> dict:
    """config.json (DmoeGptConfig's fields) of a run; tc: its model's TransformerConfig."""
    m, moe = cfg.model, cfg.moe
    pattern = moe_layer_pattern(m.num_layers, moe.layer_freq, moe.first_dense_layers) if moe.num_experts else []
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "dmoe_gpt",
        "auto_map": dict(AUTO_MAP),
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": tc.num_query_groups,
        "head_dim": tc.kv_channels,
        "intermediate_size": tc.ffn_hidden_size,
        "max_position_embeddings": m.max_position_embeddings,
        "position_embedding_type": m.position_embedding_type,
        "rotary_base": float(m.rotary_base),
        "normalization": m.normalization,
        "norm_eps": tc.layernorm_epsilon,
        "activation": m.activation,
        "add_bias_linear": m.add_bias_linear,
        "add_qkv_bias": m.add_qkv_bias,
        "qk_layernorm": m.qk_layernorm_scope if m.qk_layernorm else None,
        "moe_layers": [i for i, is_moe in enumerate(pattern) if is_moe],
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "router_score_function": moe.router_score_function,
        "router_pre_softmax": moe.router_pre_softmax,
        "router_renormalize": bool(moe.router_renormalize),
        "router_topk_scaling_factor": moe.router_topk_scaling_factor,
        "router_expert_bias": moe.router_enable_expert_bias,
        "router_num_groups": moe.router_num_groups,
        "router_group_topk": moe.router_group_topk,
        "router_group_score": moe.router_group_score,
        "shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "shared_expert_gate": moe.shared_expert_gate,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "initializer_range": m.init_method_std,
        "bos_token_id": bos,
        "eos_token_id": eod,
        "pad_token_id": None,
        "use_cache": True,
    }


def copy_modeling_file(out: Path) -> None:
    shutil.copyfile(MODELING_FILE, Path(out) / MODELING_FILE.name)
