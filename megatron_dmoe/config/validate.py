"""Check a RunConfig before anything is built, reporting every problem at once.

Each problem names its dotted key, the value found and what is allowed. Checks read the config
only: no model is built, no data file is opened (data files are checked where data is built).
Derived defaults are checked as `resolve()` would fill them, so raw and resolved configs validate
alike. Checks that depend on the machine (CUDA, Transformer Engine, apex) use an Environment,
detected here unless one is passed.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Any, List, Optional

from megatron_dmoe.parallel import layout_rules
from megatron_dmoe.parallel.layout_rules import CP_KEY, EP_KEY, ETP_KEY, PP_KEY, SP_KEY, TP_KEY, VPP_KEY, divisors

from . import moe_rules, tokenizer_types as tokenizers
from .cuda_graphs_rules import RULE_KEYS, capture_refusals
from .environment import Environment
from .errors import ConfigError, ConfigWarning, Problem
from .fields import check_type, default_of, did_you_mean, section_class, section_types
from .moe_layers import moe_layer_pattern
from .moe_settings import MOE_SETTINGS, OPTION_KEYS
from .resolve import DERIVED_FROM, resolve
from .schema import RunConfig
from .value_text import fmt, range_text

# The keys the parallel layout's rules read (parallel/layout_rules.py); validation passes the valid ones.
LAYOUT_KEYS = (TP_KEY, PP_KEY, VPP_KEY, EP_KEY, ETP_KEY, CP_KEY, SP_KEY, "model.num_layers",
               "model.num_attention_heads", "model.num_query_groups", "model.seq_length",
               "model.ffn_hidden_size", "moe.num_experts", "moe.ffn_hidden_size", "moe.expert_capacity_factor",
               "training.micro_batch_size", "training.global_batch_size")

# The MoE layer's own settings: each MoEOptions field and the YAML key it comes from. Their allowed
# values, ranges and cross-field rules are the layer's (config/moe_settings.py, config/moe_rules.py);
# the checks below report them under these keys.
MOE_KEYS = OPTION_KEYS

# Allowed values of the enumerated keys (the `a | b` comments in schema.py).
CHOICES = {
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.qk_layernorm_scope": ("head", "projection"),
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "model.cross_entropy_fusion_impl": ("auto", "triton", "native"),
    **{s.key: s.choices for s in MOE_SETTINGS if s.choices},
    "training.lr_decay_style": ("cosine", "linear", "constant"),
    "training.recompute_granularity": (None, "full", "selective"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.cuda_graphs": ("auto", True, False),
    "logging.progress_bar": ("auto", "on", "off"),
    "data.tokenizer_type": (None, *tokenizers.TOKENIZER_TYPES),
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
    "model.kv_channels": (1, None, True, None),
    "model.norm_epsilon": (0, None, False, None),
    "model.hidden_dropout": (0, 1, True, False),
    "model.attention_dropout": (0, 1, True, False),
    # the MoE settings' (config/moe_settings.py: model.hidden_size, moe.*)
    **{s.key: s.yaml_limits for s in MOE_SETTINGS if s.yaml_limits},
    "parallel.tensor_model_parallel_size": (1, None, True, None),
    "parallel.pipeline_model_parallel_size": (1, None, True, None),
    "parallel.virtual_pipeline_model_parallel_size": (1, None, True, None),
    "parallel.expert_model_parallel_size": (1, None, True, None),
    "parallel.expert_tensor_parallel_size": (1, None, True, None),
    "parallel.context_parallel_size": (1, None, True, None),
    "training.train_iters": (1, None, True, None),
    "training.micro_batch_size": (1, None, True, None),
    "training.global_batch_size": (1, None, True, None),
    "training.seed": (0, 2**32 - 1, True, True),
    "training.lr": (0, None, False, None),
    "training.min_lr": (0, None, True, None),
    "training.lr_warmup_iters": (0, None, True, None),
    "training.lr_decay_iters": (1, None, True, None),
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


def validate(cfg: RunConfig, world_size: Optional[int] = None, *,
             env: Optional[Environment] = None) -> None:
    """Raise one ConfigError listing every problem of ``cfg``; return None when there is none.

    ``world_size`` (number of processes), when known, enables the batch-size and parallel-size
    checks that depend on it. ``env`` describes the machine; None probes this one.
    """
    checker = _Checker(cfg, world_size, env)
    problems = checker.run()
    if problems:
        raise ConfigError(problems)
    for key, message in checker.warnings:
        warnings.warn(ConfigWarning(key, message), stacklevel=2)


def find_problems(cfg: RunConfig, world_size: Optional[int] = None, *,
                  env: Optional[Environment] = None) -> List[Problem]:
    """The (key, message) problems of ``cfg``; an empty list when it is valid."""
    return _Checker(cfg, world_size, env).run()


def find_warnings(cfg: RunConfig, world_size: Optional[int] = None, *,
                  env: Optional[Environment] = None) -> List[Problem]:
    """The (key, message) settings of ``cfg`` that run but are likely not meant (validate() warns
    of them with ConfigWarning)."""
    checker = _Checker(cfg, world_size, env)
    checker.run()
    return checker.warnings


class _Checker:
    def __init__(self, cfg: RunConfig, world_size: Optional[int], env: Optional[Environment]):
        self.cfg = cfg
        self.world_size = world_size
        self._env = env
        self.problems: List[Problem] = []
        self.warnings: List[Problem] = []  # settings that run, but likely not as meant
        self.bad: set = set()  # keys whose own value is wrong; checks that read them are skipped

    @property
    def env(self) -> Environment:
        if self._env is None:
            self._env = Environment.detect()
        return self._env

    # --- bookkeeping ---------------------------------------------------------------------------
    def problem(self, key: str, message: str, *, bad: bool = False) -> None:
        self.problems.append((key, message))
        if bad:
            self.bad.add(key)

    def warn(self, key: str, message: str) -> None:
        self.warnings.append((key, message))

    def raw(self, key: str) -> Any:
        """The value as given (a schema default where the given one has the wrong type)."""
        section, name = key.split(".")
        return getattr(getattr(self.sane, section), name)

    def v(self, key: str) -> Any:
        """The value after resolve() (derived defaults filled)."""
        section, name = key.split(".")
        return getattr(getattr(self.resolved, section), name)

    def ok(self, *keys: str) -> bool:
        """True when none of ``keys`` (nor what their derived default comes from) is invalid."""
        for key in keys:
            if key in self.bad:
                return False
            if self.raw(key) is None and not self.ok(*DERIVED_FROM.get(key, ())):
                return False
        return True

    # --- passes --------------------------------------------------------------------------------
    def run(self) -> List[Problem]:
        self.check_types()
        self.sane = self._sanitized()
        self.resolved = resolve(self.sane)
        self.check_choices()
        self.check_ranges()
        self.check_model()
        self.check_moe()
        self.check_upcycle()
        self.check_parallel()
        self.check_world_size()
        self.check_training()
        self.check_data()
        return self.problems

    def check_types(self) -> None:
        if not isinstance(self.cfg, RunConfig):
            raise TypeError(f"validate() needs a RunConfig, got {type(self.cfg).__name__}")
        for section, types in section_types().items():
            body = getattr(self.cfg, section)
            if not isinstance(body, section_class(section)):
                self.problem(section, f"expected a {section_class(section).__name__}, got "
                                      f"{type(body).__name__}")
                self.bad.update(f"{section}.{k}" for k in types)
                continue
            for name, annotation in types.items():
                key, value = f"{section}.{name}", getattr(body, name)
                message = check_type(value, annotation)
                if message is None and isinstance(value, float) and not math.isfinite(value):
                    message = f"expected a finite number, got {value}"
                if message:
                    self.problem(key, message, bad=True)

    def _sanitized(self) -> RunConfig:
        """A copy whose invalid values are schema defaults, so that resolve() cannot fail."""
        sections = {}
        for section, types in section_types().items():
            body = getattr(self.cfg, section)
            if not isinstance(body, section_class(section)):
                sections[section] = section_class(section)()
                continue
            values = {n: default_of(section, n) if f"{section}.{n}" in self.bad
                      else getattr(body, n) for n in types}
            sections[section] = section_class(section)(**values)
        return RunConfig(**sections)

    def check_choices(self) -> None:
        for key, allowed in CHOICES.items():
            if not self.ok(key) or self.raw(key) in allowed:
                continue
            value = self.raw(key)
            listed = ", ".join(a if isinstance(a, str) else fmt(a) for a in allowed)
            message = f"{fmt(value)} is not allowed; use one of: {listed}"
            close = isinstance(value, str) and did_you_mean(value, [a for a in allowed if isinstance(a, str)])
            if close:
                message += f" (did you mean {close}?)"
            self.problem(key, message, bad=True)

    def check_ranges(self) -> None:
        for key, (low, high, low_in, high_in) in RANGES.items():
            value = self.raw(key)
            if value is None or isinstance(value, bool) or not self.ok(key):  # true/false: no range
                continue
            too_low = low is not None and (value < low if low_in else value <= low)
            too_high = high is not None and (value > high if high_in else value >= high)
            if too_low or too_high:
                self.problem(key, f"{fmt(value)} is out of range; use "
                                  f"{range_text(low, high, low_in, high_in, value)}", bad=True)

    # --- cross-key checks ----------------------------------------------------------------------
    def check_model(self) -> None:
        v = self.v
        if self.ok("model.hidden_size", "model.num_attention_heads"):
            hidden, heads = v("model.hidden_size"), v("model.num_attention_heads")
            if hidden % heads:
                self.problem("model.hidden_size", f"{hidden} is not divisible by "
                             f"model.num_attention_heads ({heads}); use a multiple of {heads}")
        if self.raw("model.num_query_groups") is not None and self.ok(
                "model.num_query_groups", "model.num_attention_heads"):
            groups, heads = v("model.num_query_groups"), v("model.num_attention_heads")
            if heads % groups:
                self.problem("model.num_query_groups", f"{groups} does not divide "
                             f"model.num_attention_heads ({heads}); use one of: {divisors(heads)}")
        if self.raw("model.max_position_embeddings") is not None and self.ok(
                "model.seq_length", "model.max_position_embeddings"):
            seq, max_pos = v("model.seq_length"), v("model.max_position_embeddings")
            if seq > max_pos:
                self.problem("model.seq_length", f"{seq} is larger than "
                             f"model.max_position_embeddings ({max_pos}); use a sequence length "
                             f"up to {max_pos} or raise max_position_embeddings")
        release = self.env.megatron_core
        if self.ok("model.qk_layernorm", "model.qk_layernorm_scope") and v("model.qk_layernorm") \
                and v("model.qk_layernorm_scope") == "projection" and release is not None and release >= (0, 19):
            self.problem("model.qk_layernorm_scope", "projection (a query/key norm over all heads, OLMoE's) is not "
                         f"built with megatron-core {release[0]}.{release[1]}, whose attention takes per-head "
                         "query/key norms only; use megatron-core 0.16 for this model")
        if self.ok("model.transformer_impl") and not self.env.transformer_engine \
                and v("model.transformer_impl") == "transformer_engine":
            self.problem("model.transformer_impl", "'transformer_engine' needs Transformer Engine, "
                         "which cannot be imported here; use auto or local")
        if self.ok("model.cross_entropy_fusion_impl", TP_KEY) and v("model.cross_entropy_fusion_impl") == "triton" \
                and v(TP_KEY) > 1:
            self.problem("model.cross_entropy_fusion_impl", f"triton needs whole vocabulary rows, but {TP_KEY} "
                         f"is {v(TP_KEY)} (the logits are split over the vocabulary); use auto or native")

    def check_moe(self) -> None:
        """The MoE layer's rules (config/moe_rules.py) on the values the layer will get."""
        v, ok = self.v, self.ok
        if not ok("moe.num_experts") or v("moe.num_experts") == 0:
            return  # a dense model: the router keys are unused
        if ok("moe.layer_freq", "moe.first_dense_layers", "model.num_layers") \
                and not any(moe_layer_pattern(v("model.num_layers"), v("moe.layer_freq"), v("moe.first_dense_layers"))):
            layers, freq = v("model.num_layers"), v("moe.layer_freq")
            self.problem("moe.first_dense_layers", f"{v('moe.first_dense_layers')} leaves no MoE layer among the "
                         f"model's {layers} (MoE layers are every moe.layer_freq-th, {freq}, from layer 0); use "
                         f"at most {max(i for i in range(layers) if i % freq == 0)}, or moe.num_experts 0 for a "
                         f"dense model")
        values = {field: v(key) for field, key in MOE_KEYS.items() if ok(key)}
        sparse = ok("moe.backend", "training.device") and self._sparse_backend()
        precision_ok = ok("training.bf16", "training.fp16")
        element_bytes = (2 if v("training.bf16") or v("training.fp16") else 4) if precision_ok else None
        for field, message in moe_rules.option_problems(
                values, MOE_KEYS.get, sparse=sparse, ffn_shards=self._ffn_shards(v("moe.num_experts")),
                element_bytes=element_bytes):
            self.problem(MOE_KEYS[field], message)
        if ok("moe.backend", "training.device") and v("moe.backend") == "sparse" and not self._on_cuda() \
                and os.environ.get("TRITON_INTERPRET") != "1":
            self.problem("moe.backend", "sparse needs CUDA here (on CPU the block-sparse kernels run only "
                         "under Triton's interpreter, TRITON_INTERPRET=1, slowly); use auto, reference or grouped")
        if ok("moe.router_impl", "training.device") and v("moe.router_impl") == "fused" and not self._on_cuda() \
                and os.environ.get("TRITON_INTERPRET") != "1":
            self.problem("moe.router_impl", "fused needs CUDA here (on CPU its Triton kernels run only under "
                         "Triton's interpreter, TRITON_INTERPRET=1); use auto or torch")

    def check_upcycle(self) -> None:
        """checkpoint.upcycle_from and moe.upcycle_granularity: an MoE run whose experts can hold
        the dense MLP's pieces (the dense checkpoint itself is read when the run starts)."""
        v, ok = self.v, self.ok
        key, gran_key = "checkpoint.upcycle_from", "moe.upcycle_granularity"
        source = v(key) if ok(key) else None
        if not source:
            if ok(gran_key) and v(gran_key) != 1:
                self.problem(gran_key, f"{v(gran_key)} applies only to upcycling, but {key} is not set; set "
                             f"{key} or leave {gran_key} at 1")
            return
        if ok("checkpoint.load") and v("checkpoint.load"):
            self.problem(key, f"{source!r} and checkpoint.load ({v('checkpoint.load')!r}) both initialise the "
                         f"weights; keep one of them")
        if not ok("moe.num_experts") or v("moe.num_experts") == 0:
            if ok("moe.num_experts"):
                self.problem(key, f"{source!r} needs MoE layers to upcycle into, but moe.num_experts is 0; "
                             f"set moe.num_experts")
            return
        if ok(TP_KEY) and v(TP_KEY) > 1:
            self.problem(key, f"{source!r} with {TP_KEY} {v(TP_KEY)}: upcycling copies whole dense MLPs into "
                         f"the experts, at tensor-parallel size 1 only; set {TP_KEY}: 1")
        if not ok(gran_key, "model.ffn_hidden_size", "moe.ffn_hidden_size"):
            return
        n, dense, width, experts = (v(gran_key), v("model.ffn_hidden_size"), v("moe.ffn_hidden_size"),
                                    v("moe.num_experts"))
        if dense % n:
            self.problem(gran_key, f"{n} does not divide model.ffn_hidden_size ({dense}); use a divisor of {dense}")
        elif width != dense // n:
            self.problem("moe.ffn_hidden_size", f"{width} is not model.ffn_hidden_size / {gran_key} "
                         f"({dense} / {n} = {dense // n}), the width of each piece of the dense MLP; set "
                         f"moe.ffn_hidden_size: {dense // n}")
        if experts % n:
            self.problem(gran_key, f"{n} does not divide moe.num_experts ({experts}): every copy of the dense "
                         f"MLP is split into {n} experts; use a multiple of {n} experts")

    def _on_cuda(self) -> bool:
        device = self.v("training.device")
        return device == "cuda" or (device == "auto" and self.env.cuda)

    def _ffn_shards(self, experts: int) -> int:
        """Ranks each expert's FFN is split over: the expert-tensor-parallel size, times the
        expert-parallel ranks per expert when EP is a multiple of the experts."""
        ep = self.v(EP_KEY) if self.ok(EP_KEY) else 1
        etp = self.v(ETP_KEY) if self.ok(ETP_KEY) else 1
        if experts and ep > experts and ep % experts:
            ep = 1  # reported elsewhere
        return layout_rules.ffn_shards_per_expert(experts, ep, etp)

    def _sparse_backend(self) -> bool:
        backend = self.v("moe.backend")
        if backend == "sparse":
            return True
        if backend != "auto" or not self.ok("training.device"):
            return False
        # auto picks the sparse kernels on CUDA
        device = self.v("training.device")
        return device == "cuda" or (device == "auto" and self.env.cuda)

    def check_parallel(self) -> None:
        """How the model splits over the parallel sizes (parallel/layout_rules.py)."""
        values = self._layout_values()
        for key, message in layout_rules.model_split_problems(values, has_dense_mlp=self._has_dense_mlp()):
            self.problem(key, message)

    def check_world_size(self) -> None:
        """How the parallel and batch sizes fit the world size (parallel/layout_rules.py)."""
        for key, message in layout_rules.world_size_problems(self._layout_values(), self.world_size):
            self.problem(key, message)

    def _layout_values(self) -> dict:
        return {key: self.v(key) for key in LAYOUT_KEYS if self.ok(key)}

    def _has_dense_mlp(self) -> bool:
        """Does any layer have megatron's dense MLP (model.ffn_hidden_size, split over TP)?"""
        v, ok = self.v, self.ok
        if not ok("moe.num_experts", "moe.layer_freq", "moe.first_dense_layers", "model.num_layers"):
            return True
        if v("moe.num_experts") == 0:
            return True
        return not all(moe_layer_pattern(v("model.num_layers"), v("moe.layer_freq"), v("moe.first_dense_layers")))

    def check_training(self) -> None:
        v, ok = self.v, self.ok
        if ok("training.lr", "training.min_lr") and v("training.min_lr") > v("training.lr"):
            self.problem("training.min_lr", f"{fmt(v('training.min_lr'))} is larger than "
                         f"training.lr ({fmt(v('training.lr'))}); use a value from 0 to "
                         f"{fmt(v('training.lr'))}")
        warmup_key, decay_key = "training.lr_warmup_iters", "training.lr_decay_iters"
        # A warmup as long as a short run is fine (the rate is still rising when the run ends, as
        # Megatron-LM allows); the scheduler then decays after it, past the run's end.
        if ok(warmup_key, decay_key, "training.train_iters"):
            warmup, decay, iters = v(warmup_key), v(decay_key), v("training.train_iters")
            if warmup >= iters and decay >= iters:
                self.warn(warmup_key, f"{warmup} is not shorter than training.train_iters ({iters}): "
                          f"the learning rate is still rising when the run ends and never decays; "
                          f"use fewer warmup iterations for a full schedule")
            elif decay <= warmup:  # a decay that ends within the run must outlast the warmup
                self.problem(decay_key, f"{decay} is not larger than {warmup_key} ({warmup}); use "
                             f"more than {warmup}, or null (= train_iters)")
        if ok("training.bf16", "training.fp16") and v("training.bf16") and v("training.fp16"):
            self.problem("training.fp16", "true together with training.bf16: true; choose one")
        if ok("training.loss_scale", "training.fp16") and not v("training.fp16") \
                and self.raw("training.loss_scale") is not None:
            self.problem("training.loss_scale", "is used only with training.fp16: true; set it to "
                         "null or enable fp16")
        if ok("training.eval_interval", "training.eval_iters") and v("training.eval_interval") > 0 \
                and v("training.eval_iters") == 0:
            self.problem("training.eval_iters", f"0 with training.eval_interval "
                         f"{v('training.eval_interval')} would evaluate nothing; use at least 1, "
                         f"or training.eval_interval: 0 to disable evaluation")
        if ok("training.device") and v("training.device") == "cuda" and not self.env.cuda:
            self.problem("training.device", "'cuda' but CUDA is not available here; use auto or "
                         "cpu")
        self._check_cuda_graphs()
        self._check_ep_exchange()
        self._check_expert_wgrad_per_step()

        for key in ("training.bf16", "training.fp16"):
            if ok(key, "training.device") and v(key):
                device = v("training.device")
                if device == "cpu" or (device == "auto" and not self.env.cuda):
                    self.problem(key, "true needs CUDA (megatron-core's mixed-precision optimizer "
                                 "keeps fp32 master weights on the GPU); on CPU train in fp32 "
                                 "(set it to false)")

    def _check_cuda_graphs(self) -> None:
        """`true` only where capture is correct (config/cuda_graphs_rules.py); `auto` is resolved
        at start-up instead, off with a note where it is not."""
        key = "training.cuda_graphs"
        if not self.ok(key) or self.v(key) is not True:
            return
        values = {k: self.v(k) for k in RULE_KEYS if self.ok(k)}
        for why, fix in capture_refusals(values, self.env.cuda, self.env.transformer_engine):
            self.problem(key, f"true cannot be captured: {why}; {fix}")

    def _check_expert_wgrad_per_step(self) -> None:
        """Only the sparse backend defers its weight gradients, and a captured graph replays the
        per-micro-batch accumulation: refuse a setting that would silently do nothing."""
        v, ok, key = self.v, self.ok, "moe.expert_wgrad_per_step"
        if not ok(key, "moe.num_experts", "moe.backend") or not v(key) or v("moe.num_experts") == 0:
            return
        backend = v("moe.backend")
        if backend == "auto" and (not self.env.cuda or (ok("training.device") and v("training.device") == "cpu")):
            backend = "reference"  # what auto picks without CUDA
        if backend in ("grouped", "reference"):
            self.problem(key, f"true needs the sparse expert backend, but moe.backend is {v('moe.backend')} "
                         f"(here: {backend}); set moe.backend: sparse, or set {key}: false")
        if ok("training.cuda_graphs") and v("training.cuda_graphs") is True:
            self.problem(key, "true has no effect with training.cuda_graphs: true (the captured layers "
                         "accumulate per micro-batch); set one of them to false")

    def _check_ep_exchange(self) -> None:
        """The symmetric and NVSHMEM exchanges move rows through GPU memory mapped between ranks: CUDA only."""
        v, ok, key = self.v, self.ok, "moe.ep_exchange"
        if not ok(key) or v(key) not in ("symmetric", "nvshmem"):
            return
        if (ok("training.device") and v("training.device") == "cpu") or not self.env.cuda:
            how = ("stores rows straight into peer GPUs' memory" if v(key) == "symmetric"
                   else "moves rows between GPUs' symmetric memory")
            self.problem(key, f"{v(key)} needs CUDA GPUs (it {how}); use auto or nccl")

    def check_tokenizer(self) -> None:
        """Megatron-LM's tokenizer types and the files each needs (config/tokenizer_types.py); the files
        themselves are read where the data is built."""
        v, ok, key = self.v, self.ok, "data.tokenizer_type"
        if not ok(key, "data.data_path") or v(key) is None:
            return
        kind = v(key)
        if not v("data.data_path"):
            self.problem(key, f"{kind} names the tokenizer of your data, but data.data_path is empty (the "
                         f"built-in corpus has its own tokenizer); set data.data_path or unset {key}")
            return
        missing = [f"data.{name} ({tokenizers.FLAGS[name]})" for name in tokenizers.REQUIRED_KEYS[kind]
                   if ok(f"data.{name}") and v(f"data.{name}") in (None, "")]
        if missing:
            self.problem(key, f"{kind} needs {' and '.join(missing)}")
        module = tokenizers.missing_module(kind)
        if module:
            self.problem(key, f"{kind} needs the Python package {module}")
        for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
            if name not in tokenizers.REQUIRED_KEYS[kind] and ok(f"data.{name}") and v(f"data.{name}") is not None:
                self.warn(f"data.{name}", f"is not used by {key} {kind} (it reads "
                          f"{', '.join('data.' + n for n in tokenizers.REQUIRED_KEYS[kind])})")

    def check_data(self) -> None:
        self.check_tokenizer()
        if self.ok("data.data_path"):
            message = _data_path_problem(self.v("data.data_path"))
            if message:
                self.problem("data.data_path", message)
        if self.ok("data.split"):
            message = _split_problem(self.v("data.split"))
            if message:
                self.problem("data.split", message)
        if self.ok("data.valid_data_path", "data.data_path") and self.v("data.valid_data_path"):
            message = _data_path_problem(self.v("data.valid_data_path"))
            if message:
                self.problem("data.valid_data_path", message)
            elif not self.v("data.data_path"):
                self.problem("data.valid_data_path", "is set but data.data_path is empty: separate "
                             "validation data needs training data of the same tokenizer; set "
                             "data.data_path, or leave both unset for the built-in corpus")


def _as_number(text: str) -> Optional[float]:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _data_path_problem(items: List[str]) -> Optional[str]:
    shape = "use [prefix] or [weight, prefix, weight, prefix, ...]"
    if len(items) <= 1:
        if items and not items[0].strip():
            return f"the prefix is empty; {shape}"
        return None
    if len(items) % 2:
        return f"{len(items)} items, but weights and prefixes come in pairs; {shape}"
    for i in range(0, len(items), 2):
        weight, prefix = items[i], items[i + 1]
        number = _as_number(weight)
        if number is None:
            return f"item {i + 1} ({weight!r}) should be a weight (a number); {shape}"
        if number <= 0:
            return f"weight {weight} (item {i + 1}) must be positive; {shape}"
        if not prefix.strip() or _as_number(prefix) is not None:
            return f"item {i + 2} ({prefix!r}) should be a path prefix; {shape}"
    return None


def _split_problem(text: str) -> Optional[str]:
    shape = "use three non-negative numbers 'train,valid,test' such as '969,30,1'"
    parts = text.split(",")
    numbers = [_as_number(p.strip()) for p in parts]
    if len(parts) != 3 or any(n is None for n in numbers):
        return f"{text!r} is not three numbers; {shape}"
    if any(n < 0 for n in numbers):
        return f"{text!r} has a negative part; {shape}"
    if sum(numbers) <= 0:
        return f"{text!r} sums to 0; {shape}"
    return None
