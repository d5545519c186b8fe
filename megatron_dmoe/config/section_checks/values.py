"""Each key on its own: its type, its allowed values and its range. A key found invalid here is
marked bad, and replaced by its schema default in the copy the cross-key checks read."""
from __future__ import annotations

import math

from ..fields import check_type, default_of, did_you_mean, section_class, section_types
from ..moe_settings import MOE_SETTINGS
from ..schema import RunConfig
from ..tokenizer_types import TOKENIZER_TYPES
from ..value_text import fmt, range_text
from .state import CheckState

# Allowed values of the enumerated keys (the `a | b` comments in schema.py).
CHOICES = {
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.qk_layernorm_scope": ("head", "projection"),
    "model.rope_type": (None, "rope", "yarn"),
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "model.cross_entropy_fusion_impl": ("auto", "triton", "native"),
    **{s.key: s.choices for s in MOE_SETTINGS if s.choices},
    "training.lr_decay_style": ("cosine", "linear", "constant", "WSD"),
    "training.lr_wsd_decay_style": ("exponential", "linear", "cosine", "minus_sqrt"),
    "logging.wandb_mode": (None, "online", "offline"),
    "training.recompute_granularity": (None, "full", "selective"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.cuda_graphs": ("auto", True, False),
    "parallel.overlap_grad_reduce": ("auto", True, False),
    "parallel.overlap_param_gather": ("auto", True, False),
    "logging.progress_bar": ("auto", "on", "off"),
    "data.tokenizer_type": (None, *TOKENIZER_TYPES),
}

# Single-key ranges: (lowest, highest, lowest allowed?, highest allowed?); None = unbounded.
RANGES = {
    "model.num_layers": (1, None, True, None),
    "model.num_attention_heads": (1, None, True, None),
    "model.num_query_groups": (1, None, True, None),
    "model.ffn_hidden_size": (1, None, True, None),
    "model.seq_length": (1, None, True, None),
    "model.max_position_embeddings": (1, None, True, None),
    "model.vocab_size": (1, None, True, None),
    "model.make_vocab_size_divisible_by": (1, None, True, None),
    "model.rotary_base": (0, None, False, None),
    "model.rotary_percent": (0, 1, False, True),
    "model.kv_channels": (1, None, True, None),
    "model.norm_epsilon": (0, None, False, None),
    "model.hidden_dropout": (0, 1, True, False),
    "model.attention_dropout": (0, 1, True, False),
    "model.q_lora_rank": (1, None, True, None),
    "model.kv_lora_rank": (1, None, True, None),
    "model.qk_head_dim": (1, None, True, None),
    "model.qk_pos_emb_head_dim": (2, None, True, None),
    "model.v_head_dim": (1, None, True, None),
    "model.rotary_scaling_factor": (0, None, False, None),
    "model.original_max_position_embeddings": (1, None, True, None),
    "model.beta_fast": (0, None, False, None),
    "model.beta_slow": (0, None, False, None),
    "model.mscale": (0, None, True, None),
    "model.mscale_all_dim": (0, None, True, None),
    # the MoE settings' (config/moe_settings.py: model.hidden_size, moe.*)
    **{s.key: s.yaml_limits for s in MOE_SETTINGS if s.yaml_limits},
    "parallel.tensor_model_parallel_size": (1, None, True, None),
    "parallel.pipeline_model_parallel_size": (1, None, True, None),
    "parallel.virtual_pipeline_model_parallel_size": (1, None, True, None),
    "parallel.expert_model_parallel_size": (1, None, True, None),
    "parallel.expert_tensor_parallel_size": (1, None, True, None),
    "parallel.context_parallel_size": (1, None, True, None),
    "parallel.ddp_bucket_size": (1, None, True, None),
    "training.train_iters": (1, None, True, None),
    "training.micro_batch_size": (1, None, True, None),
    "training.global_batch_size": (1, None, True, None),
    "training.seed": (0, 2**32 - 1, True, True),
    "training.lr": (0, None, False, None),
    "training.min_lr": (0, None, True, None),
    "training.lr_warmup_iters": (0, None, True, None),
    "training.lr_decay_iters": (1, None, True, None),
    "training.lr_wsd_decay_iters": (1, None, True, None),
    "training.weight_decay": (0, None, True, None),
    "training.adam_beta1": (0, 1, True, False),
    "training.adam_beta2": (0, 1, True, False),
    "training.adam_eps": (0, None, False, None),
    "training.clip_grad": (0, None, True, None),
    "training.loss_scale": (0, None, False, None),
    "training.initial_loss_scale": (0, None, False, None),
    "training.eval_interval": (0, None, True, None),
    "training.eval_iters": (0, None, True, None),
    "training.time_limit_minutes": (0, None, False, None),
    "training.memory_check": (0, 1, False, True),  # or true / false
    "data.builtin_vocab_size": (1, None, True, None),
    "data.vocab_size": (1, None, True, None),
    "data.num_workers": (0, None, True, None),
    "checkpoint.save_interval": (0, None, True, None),
    "checkpoint.keep_last": (0, None, True, None),
    "logging.log_interval": (1, None, True, None),
    "logging.peak_tflops": (0, None, False, None),
}


def check_types(state: CheckState) -> None:
    if not isinstance(state.cfg, RunConfig):
        raise TypeError(f"validate() needs a RunConfig, got {type(state.cfg).__name__}")
    for section, types in section_types().items():
        body = getattr(state.cfg, section)
        if not isinstance(body, section_class(section)):
            state.problem(section, f"expected a {section_class(section).__name__}, got "
                                  f"{type(body).__name__}")
            state.bad.update(f"{section}.{k}" for k in types)
            continue
        for name, annotation in types.items():
            key, value = f"{section}.{name}", getattr(body, name)
            message = check_type(value, annotation)
            if message is None and isinstance(value, float) and not math.isfinite(value):
                message = f"expected a finite number, got {value}"
            if message:
                state.problem(key, message, bad=True)


def sanitized(state: CheckState) -> RunConfig:
    """A copy whose invalid values are schema defaults, so that resolve() cannot fail."""
    sections = {}
    for section, types in section_types().items():
        body = getattr(state.cfg, section)
        if not isinstance(body, section_class(section)):
            sections[section] = section_class(section)()
            continue
        values = {n: default_of(section, n) if f"{section}.{n}" in state.bad
                  else getattr(body, n) for n in types}
        sections[section] = section_class(section)(**values)
    return RunConfig(**sections)


def check_choices(state: CheckState) -> None:
    for key, allowed in CHOICES.items():
        if not state.ok(key) or state.raw(key) in allowed:
            continue
        value = state.raw(key)
        listed = ", ".join(a if isinstance(a, str) else fmt(a) for a in allowed)
        message = f"{fmt(value)} is not allowed; use one of: {listed}"
        close = isinstance(value, str) and did_you_mean(value, [a for a in allowed if isinstance(a, str)])
        if close:
            message += f" (did you mean {close}?)"
        state.problem(key, message, bad=True)


# Keys that take `auto` (decided at start-up) or a number in their RANGES.
AUTO_OR_NUMBER = ("moe.expert_wgrad_window",)


def check_ranges(state: CheckState) -> None:
    for key in AUTO_OR_NUMBER:
        value = state.raw(key)
        if state.ok(key) and isinstance(value, str) and value != "auto":
            state.problem(key, f"{fmt(value)} is not allowed; use auto or a whole number >= 1", bad=True)
    for key, (low, high, low_in, high_in) in RANGES.items():
        value = state.raw(key)
        if value is None or isinstance(value, (bool, str)) or not state.ok(key):  # true/false, auto: no range
            continue
        too_low = low is not None and (value < low if low_in else value <= low)
        too_high = high is not None and (value > high if high_in else value >= high)
        if too_low or too_high:
            state.problem(key, f"{fmt(value)} is out of range; use "
                              f"{range_text(low, high, low_in, high_in, value)}", bad=True)
