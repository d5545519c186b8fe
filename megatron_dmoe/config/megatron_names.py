"""Megatron-LM's argument names and the keys they are here.

`dmoe-train` accepts Megatron-LM's flags that have a key (`--micro-batch-size 4` is
`training.micro_batch_size=4`), and a Megatron-LM name typed as a key (`moe.moe_router_topk`) gets
the key to use. The flags without a key of the same name (accepted with no effect, translated, or
refused with what to use instead) are listed in config/megatron_flags.py.
"""
from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from .megatron_flags import NO_OPS, REFUSED, REFUSED_SWITCHES, REFUSED_VALUES, VALUE_MAPS, refusal
from .moe_settings import MOE_SETTINGS

# Megatron-LM argument (its dest, flag without the dashes) -> our key, where they differ only by
# section; the MoE settings' come from config/moe_settings.py
_SAME_NAME = {
    "model": ["num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "position_embedding_type",
              "rotary_base", "rotary_percent", "normalization", "kv_channels", "norm_epsilon", "qk_layernorm",
              "hidden_dropout", "attention_dropout", "add_qkv_bias",
              "untie_embeddings_and_output_weights", "transformer_impl", "cross_entropy_loss_fusion",
              "cross_entropy_fusion_impl", "use_cpu_initialization",
              # multi-latent attention (Megatron-LM's mla group and --rope-type)
              "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim"],
    "parallel": ["tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "sequence_parallel", "context_parallel_size",
                 "virtual_pipeline_model_parallel_size", "overlap_grad_reduce", "overlap_param_gather",
                 "ddp_bucket_size"],
    "training": ["train_iters", "micro_batch_size", "global_batch_size", "seed", "lr", "min_lr",
                 "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "weight_decay", "adam_beta1",
                 "adam_beta2", "adam_eps", "clip_grad", "bf16", "fp16", "loss_scale", "initial_loss_scale",
                 "eval_interval", "eval_iters", "recompute_granularity", "use_distributed_optimizer",
                 "lr_wsd_decay_style", "lr_wsd_decay_iters"],
    "data": ["data_path", "valid_data_path", "split", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
             "vocab_size", "num_workers"],
    "checkpoint": ["save_interval", "load", "finetune"],
    "logging": ["log_interval", "tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir"],
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
# the Megatron-LM flags (names without dashes) that set a key; MEGATRON_KEYS also holds megatron-core's
# TransformerConfig names of the MoE settings (num_moe_experts), which are no flags
FLAG_NAMES = {name for names in _SAME_NAME.values() for name in names} | {flag_name(s.flag) for s in _MOE_FLAGS}
# flags that take no value (store_true in Megatron-LM): `--bf16` is training.bf16=true
SWITCHES = {"untie_embeddings_and_output_weights", "use_cpu_initialization", "cross_entropy_loss_fusion",
            "qk_layernorm", "add_qkv_bias", "multi_latent_attention",
            "sequence_parallel", "bf16", "fp16", "use_distributed_optimizer", "overlap_grad_reduce",
            "overlap_param_gather", "finetune",
            *(flag_name(s.flag) for s in _MOE_FLAGS if s.switch)}
# switches that set a key to a value: `--swiglu` is model.activation=swiglu
VALUE_SWITCHES = {"swiglu": ("model.activation", "swiglu"), "disable_bias_linear": ("model.add_bias_linear", "false"),
                  "no_load_optim": ("checkpoint.load_optim", "false"), "no_load_rng": ("checkpoint.load_rng", "false")}
# flags that take several values (nargs='*')
LISTS = {"data_path", "valid_data_path"}


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


def flags_to_overrides(argv: List[str], own_flags: Sequence[str]) -> Tuple[List[str], List[str], List[str], List[str]]:
    """Megatron-LM flags in a command line -> (the rest of argv, `key=value` overrides, problems,
    the flags accepted with no effect).

    `--micro-batch-size 4` and `--micro-batch-size=4` give training.micro_batch_size=4, `--bf16`
    training.bf16=true, `--data-path 0.3 a 0.7 b` data.data_path=[...]. Flags in `own_flags` (and
    anything after `--`) are left alone; config/megatron_flags.py's no-ops are dropped (and named in
    the fourth list), its translated values set their keys, and a refused or unknown `--flag` is a
    problem (one each) naming what to type.
    """
    rest: List[str] = []
    overrides: List[str] = []
    last: List[str] = []  # applied after every other flag (--moe-router-load-balancing-type none)
    problems: List[str] = []
    ignored: List[str] = []
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
        takes_value = not (name in SWITCHES or name in VALUE_SWITCHES or NO_OPS.get(name) is False
                           or name in REFUSED_SWITCHES or name == "no_position_embedding")
        if not takes_value:
            if has_value:
                problems.append(f"{flag} takes no value (it is a switch), got {arg!r}")
            elif name == "sequence_parallel" and _flag_value(argv, "--tensor-model-parallel-size", "1") == "1":
                ignored.append(f"{flag} (at tensor-parallel size 1 Megatron-LM turns it off too)")
            elif name in SWITCHES:
                overrides.append(f"{MEGATRON_KEYS[name]}=true")
            elif name in VALUE_SWITCHES:
                key, value = VALUE_SWITCHES[name]
                overrides.append(f"{key}={value}")
            elif name in REFUSED:
                problems.append(refusal(flag, name))
            elif name == "no_position_embedding":
                problem = _no_position_embedding(argv)
                problems += [problem] if problem else []
                ignored += [] if problem else [flag]
            else:
                ignored.append(flag)
            continue
        if name not in MEGATRON_KEYS and name not in NO_OPS and name not in VALUE_MAPS and name not in REFUSED:
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
        if name in REFUSED:
            problems.append(refusal(flag, name))
            continue
        if not values:
            what = MEGATRON_KEYS.get(name, "a Megatron-LM setting")
            problems.append(f"{flag} needs a value (it is {what})")
            continue
        if name in NO_OPS:
            ignored.append(f"{flag} {values[0]}")
        elif name in VALUE_MAPS:
            if values[0] not in VALUE_MAPS[name]:
                problems.append(f"{flag} {values[0]} is not supported: {REFUSED_VALUES[name]}")
            elif VALUE_MAPS[name][values[0]] is not None:
                key, value = VALUE_MAPS[name][values[0]]
                (last if values[0] == "none" else overrides).append(f"{key}={value}")
        elif name == "moe_layer_freq" and _DENSE_FIRST.fullmatch(values[0].replace(" ", "")):
            # DeepSeek's pattern "([0]*N+[1]*M)": N dense layers, then MoE in every layer
            dense = _DENSE_FIRST.fullmatch(values[0].replace(" ", "")).group(1)
            overrides += [f"moe.first_dense_layers={dense}", "moe.layer_freq=1"]
        else:
            value = json.dumps(values) if name in LISTS else values[0]
            overrides.append(f"{MEGATRON_KEYS[name]}={value}")
    return rest, overrides + last, problems, ignored


_DENSE_FIRST = re.compile(r"\(?\[0\]\*(\d+)\+\[1\]\*\d+\)?")


def _flag_value(argv: List[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    """The value the command line gives `flag` (its last), else `default`."""
    value = default
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            value = arg.partition("=")[2]
        elif arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def _no_position_embedding(argv: List[str]) -> Optional[str]:
    """--no-position-embedding drops the learned position embedding: with RoPE (which has none) it
    changes nothing; a model without positions at all is not built here."""
    if _flag_value(argv, "--position-embedding-type") == "rope":
        return None
    return ("--no-position-embedding is accepted with --position-embedding-type rope only (RoPE adds no "
            "embedding); a model without positions is not supported: add --position-embedding-type rope")


def _unknown_flag(flag: str, own_flags: Sequence[str]) -> str:
    import difflib

    names = [*MEGATRON_KEYS, *SWITCHES, *VALUE_SWITCHES, *NO_OPS, *VALUE_MAPS]
    options = list(own_flags) + ["--" + n.replace("_", "-") for n in names]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{flag} is neither an option of this command nor a Megatron-LM flag with a config key; "
            f"{hint}settings are section.key=value overrides (see the README's Configuration)")
