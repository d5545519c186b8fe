"""Megatron-LM's argument names and the keys they are here.

`dmoe-train` accepts Megatron-LM's flags that have a key (`--micro-batch-size 4` is
`training.micro_batch_size=4`), and a Megatron-LM name typed as a key (`moe.moe_router_topk`) gets
the key to use.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from .moe_settings import MOE_SETTINGS

# Megatron-LM argument (its dest, flag without the dashes) -> our key, where they differ only by
# section; the MoE settings' come from config/moe_settings.py
_SAME_NAME = {
    "model": ["num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "position_embedding_type",
              "rotary_base", "normalization", "kv_channels", "norm_epsilon", "qk_layernorm", "hidden_dropout",
              "attention_dropout", "add_qkv_bias",
              "untie_embeddings_and_output_weights", "transformer_impl", "cross_entropy_loss_fusion",
              "cross_entropy_fusion_impl", "use_cpu_initialization",
              # multi-latent attention (Megatron-LM's mla group and --rope-type)
              "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim"],
    "parallel": ["tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "sequence_parallel", "context_parallel_size",
                 "virtual_pipeline_model_parallel_size"],
    "training": ["train_iters", "micro_batch_size", "global_batch_size", "seed", "lr", "min_lr",
                 "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "weight_decay", "adam_beta1",
                 "adam_beta2", "adam_eps", "clip_grad", "bf16", "fp16", "loss_scale", "initial_loss_scale",
                 "eval_interval", "eval_iters", "recompute_granularity", "use_distributed_optimizer"],
    "data": ["data_path", "split", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
             "num_workers"],
    "checkpoint": ["save_interval", "load"],
    "logging": ["log_interval"],
}


def flag_name(flag: str) -> str:
    """'--micro-batch-size' -> 'micro_batch_size'."""
    return flag.lstrip("-").replace("-", "_")


_MOE_FLAGS = [s for s in MOE_SETTINGS if s.flag]
MEGATRON_KEYS: Dict[str, str] = {
    **{name: f"{section}.{name}" for section, names in _SAME_NAME.items() for name in names},
    **{flag_name(s.flag): s.key for s in _MOE_FLAGS},
    # megatron-core's TransformerConfig field, where its name differs from the flag (num_moe_experts)
    **{s.megatron: s.key for s in _MOE_FLAGS if s.megatron},
}
# flags that take no value (store_true in Megatron-LM): `--bf16` is training.bf16=true
SWITCHES = {"untie_embeddings_and_output_weights", "use_cpu_initialization", "cross_entropy_loss_fusion",
            "qk_layernorm", "add_qkv_bias", "multi_latent_attention",
            "sequence_parallel", "bf16", "fp16", "use_distributed_optimizer",
            *(flag_name(s.flag) for s in _MOE_FLAGS if s.switch)}
# switches that set a key to a value: `--swiglu` is model.activation=swiglu
VALUE_SWITCHES = {"swiglu": ("model.activation", "swiglu"), "disable_bias_linear": ("model.add_bias_linear", "false")}
# flags that take several values (nargs='*')
LISTS = {"data_path"}


def megatron_match(name: str, section: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """(Megatron-LM's argument name, our key) for a Megatron-LM name typed as a key
    (`moe_router_topk`, or inside a section `router_topk` / `moe_router_topk`), or None. A switch
    that sets a value gives the key as 'model.activation: swiglu'."""
    name = name.replace("-", "_")
    candidates = [name]
    if section:
        candidates += [f"{section}_{name}", f"moe_{name}"] if section == "moe" else [f"{section}_{name}"]
    for candidate in candidates:
        if candidate in MEGATRON_KEYS:
            return candidate, MEGATRON_KEYS[candidate]
        if candidate in VALUE_SWITCHES:
            key, value = VALUE_SWITCHES[candidate]
            return candidate, f"{key}: {value}"
    return None


def key_for_megatron_name(name: str, section: Optional[str] = None) -> Optional[str]:
    match = megatron_match(name, section)
    return match[1] if match else None


def flags_to_overrides(argv: List[str], own_flags: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
    """Megatron-LM flags in a command line -> (the rest of argv, `key=value` overrides, problems).

    `--micro-batch-size 4` and `--micro-batch-size=4` give training.micro_batch_size=4, `--bf16`
    training.bf16=true, `--data-path 0.3 a 0.7 b` data.data_path=[...]. Flags in `own_flags` (and
    anything after `--`) are left alone; an unknown `--flag` is a problem naming what to type.
    """
    rest: List[str] = []
    overrides: List[str] = []
    problems: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            rest += argv[i - 1:]
            break
        if not arg.startswith("--") or arg.split("=", 1)[0] in own_flags:
            rest.append(arg)
            continue
        flag, has_value, inline = arg.partition("=")
        name = flag_name(flag)
        if name in SWITCHES or name in VALUE_SWITCHES:
            if has_value:
                problems.append(f"{flag} takes no value (it is a switch), got {arg!r}")
            elif name in SWITCHES:
                overrides.append(f"{MEGATRON_KEYS[name]}=true")
            else:
                key, value = VALUE_SWITCHES[name]
                overrides.append(f"{key}={value}")
            continue
        if name not in MEGATRON_KEYS:
            problems.append(_unknown_flag(flag, own_flags))
            continue
        if has_value:
            values = [inline]
        else:
            values = []
            while i < len(argv) and not argv[i].startswith("--") and "=" not in argv[i]:
                values.append(argv[i])
                i += 1
                if name not in LISTS:
                    break
        if not values:
            problems.append(f"{flag} needs a value (it is {MEGATRON_KEYS[name]})")
            continue
        value = json.dumps(values) if name in LISTS else values[0]
        overrides.append(f"{MEGATRON_KEYS[name]}={value}")
    return rest, overrides, problems


def _unknown_flag(flag: str, own_flags: Sequence[str]) -> str:
    import difflib

    options = list(own_flags) + ["--" + n.replace("_", "-") for n in [*MEGATRON_KEYS, *SWITCHES, *VALUE_SWITCHES]]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{flag} is neither an option of this command nor a Megatron-LM flag with a config key; "
            f"{hint}settings are section.key=value overrides (see the README's Configuration)")
