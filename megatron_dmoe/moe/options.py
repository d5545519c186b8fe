"""Settings of one MoE layer, validated once, and their mapping from megatron-core's TransformerConfig."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.nn.functional as F

# The MoE layer's rules, in one place: MoEOptions obeys them and config/validate.py reports them for
# a run configuration (under its YAML keys, through `option_problems(values, key=...)`).
ACTIVATIONS = ("gelu", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
BACKENDS = ("auto", "sparse", "grouped", "reference")
BLOCK_SIZES = (16, 32, 64, 128)  # the block-sparse kernels' (dmoe_kernels.products.topology)
EP_EXCHANGES = ("auto", "nccl", "symmetric")
# what the load-balancing loss's expert fractions are counted over (megatron-core: aux_loss,
# seq_aux_loss, global_aux_loss; see AUX_LOSS_TYPES_MEGATRON)
AUX_LOSS_TYPES = ("micro_batch", "sequence", "global")
# how group-limited routing scores a group: the sum of its best top_k / group_topk scores
# (megatron-core, DeepSeek-V3) or its best score (DeepSeek-V2)
GROUP_SCORES = ("sum", "max")
# how the router's softmax and top-k run: auto (the fused Triton kernels for fp32 CUDA logits where
# the options allow them, else torch), fused (always; an error where they cannot), torch
ROUTER_IMPLS = ("auto", "fused", "torch")
FUSED_ROUTER_MAX_EXPERTS = 256  # dmoe_kernels.router.ops.MAX_EXPERTS
AUX_LOSS_TYPES_MEGATRON = {"aux_loss": "micro_batch", "seq_aux_loss": "sequence", "global_aux_loss": "global"}

# field: allowed values
CHOICES = {
    "activation": ACTIVATIONS,
    "score_function": SCORE_FUNCTIONS,
    "token_drop_policy": DROP_POLICIES,
    "backend": BACKENDS,
    "block_size": BLOCK_SIZES,
    "ep_exchange": EP_EXCHANGES,
    "aux_loss_type": AUX_LOSS_TYPES,
    "router_group_score": GROUP_SCORES,
    "router_impl": ROUTER_IMPLS,
}
# field: (lowest, highest, lowest allowed?, highest allowed?); None = unbounded or not given
RANGES = {
    "hidden_size": (1, None, True, None),
    "ffn_hidden_size": (1, None, True, None),
    "num_experts": (1, None, True, None),
    "top_k": (1, None, True, None),
    "topk_scaling_factor": (0, None, False, None),
    "input_jitter_eps": (0, 1, True, False),
    "aux_loss_coeff": (0, None, True, None),
    "z_loss_coeff": (0, None, True, None),
    "bias_update_rate": (0, None, True, None),
    "capacity_factor": (0, None, False, None),
    "init_method_std": (0, None, False, None),
    "shared_expert_ffn_hidden_size": (0, None, True, None),
    "router_num_groups": (1, None, True, None),
    "router_group_topk": (1, None, True, None),
}
_INTEGERS = ("hidden_size", "ffn_hidden_size", "num_experts", "top_k", "block_size",
             "shared_expert_ffn_hidden_size", "router_num_groups", "router_group_topk")


def fmt(value) -> str:
    """A value as written in YAML (true, null, 0.5, 'softmax')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def range_text(low, high, low_in, high_in, value) -> str:
    kind = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a number"
    if high is None:
        return f"{kind} {'>=' if low_in else '>'} {fmt(low)}"
    return f"{kind} with {fmt(low)} {'<=' if low_in else '<'} value {'<=' if high_in else '<'} {fmt(high)}"


def choice_problem(field: str, value) -> Optional[str]:
    allowed = CHOICES[field]
    if value in allowed and not isinstance(value, bool):
        return None
    return f"{fmt(value)} is not allowed; use one of: {', '.join(a if isinstance(a, str) else fmt(a) for a in allowed)}"


def range_problem(field: str, value) -> Optional[str]:
    if value is None:
        return None
    low, high, low_in, high_in = RANGES[field]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if field in _INTEGERS and not (isinstance(value, int) and not isinstance(value, bool)):
        number = False
    too_low = number and low is not None and (value < low if low_in else value <= low)
    too_high = number and high is not None and (value > high if high_in else value >= high)
    if number and not (too_low or too_high):
        return None
    return f"{fmt(value)} is out of range; use {range_text(low, high, low_in, high_in, value if number else 0.0)}"


def option_problems(values: Dict[str, Any], key: Callable[[str], str] = lambda field: field, *,
                    sparse: Optional[bool] = None, ffn_shards: int = 1,
                    element_bytes: Optional[int] = None) -> List[Tuple[str, str]]:
    """Every broken rule among `values` (MoEOptions fields; absent ones are not checked), as
    (field, message) with other fields named by `key(field)` (config/validate.py passes YAML keys).

    sparse: whether the block-sparse kernels will run the experts (None: only when backend is
    'sparse'); ffn_shards: ranks each expert's FFN is split over (expert parallelism beyond the
    expert count), each shard must be a multiple of the block size; element_bytes: size of the
    parameters' dtype, for the grouped backend's alignment (None: not checked).
    """
    problems: List[Tuple[str, str]] = []
    bad = set()

    def report(field, message):
        problems.append((field, message))
        bad.add(field)

    for field in CHOICES:
        if field in values and (message := choice_problem(field, values[field])):
            report(field, message)
    for field in RANGES:
        if field in values and (message := range_problem(field, values[field])):
            report(field, message)

    def have(*fields):
        return all(f in values and f not in bad for f in fields)

    get = values.get
    if have("top_k", "num_experts") and get("top_k") > get("num_experts"):
        report("top_k", f"{get('top_k')} is larger than {key('num_experts')} ({get('num_experts')}); "
                        f"use a value from 1 to {get('num_experts')}")
    single_weight = False
    if have("top_k", "score_function", "pre_softmax") and get("top_k") == 1 \
            and get("score_function") == "softmax" and not get("pre_softmax"):
        single_weight = True
        report("pre_softmax", f"false with {key('top_k')} 1 and softmax scores makes every routing "
                              f"weight 1, so the router gets no gradient; set it to true or use "
                              f"{key('top_k')} >= 2")
    if not single_weight and have("top_k", "renormalize") and get("top_k") == 1 and get("renormalize") is True:
        report("renormalize", f"true with {key('top_k')} 1 makes every routing weight 1, so the router "
                              f"gets no gradient; use false or null")
    if have("expert_bias", "score_function") and get("expert_bias") and get("score_function") != "sigmoid":
        # megatron-core's TransformerConfig refuses it too: the bias is added to sigmoid scores
        report("expert_bias", f"true needs {key('score_function')}: sigmoid (aux-loss-free balancing "
                              f"adds the bias to sigmoid scores), but it is {fmt(get('score_function'))}; "
                              f"set {key('score_function')}: sigmoid or {key('expert_bias')}: false")
    _group_problems(values, key, have, report)
    if get("router_impl") == "fused":
        reason = fused_router_unsupported(values, key)
        if reason is not None:
            report("router_impl", f"fused cannot route with {reason}; use auto or torch")
    if have("shared_expert_gate", "shared_expert_ffn_hidden_size") and get("shared_expert_gate") \
            and not get("shared_expert_ffn_hidden_size"):
        report("shared_expert_gate", f"true without a shared expert ({key('shared_expert_ffn_hidden_size')} "
                                     f"is 0); set {key('shared_expert_ffn_hidden_size')} or "
                                     f"{key('shared_expert_gate')}: false")
    if sparse is None:
        sparse = get("backend") == "sparse"
    if sparse and have("ffn_hidden_size", "block_size"):
        width, block = get("ffn_hidden_size"), get("block_size")
        if ffn_shards > 1:
            if width % ffn_shards == 0 and (width // ffn_shards) % block:
                report("ffn_hidden_size", f"{width} split over {ffn_shards} ranks per expert gives shards of "
                       f"{width // ffn_shards}, not a multiple of {key('block_size')} ({block}), which the "
                       f"sparse backend needs; use a multiple of {ffn_shards * block} or "
                       f"{key('backend')}: grouped")
        elif width % block:
            lower, upper = width // block * block, (width // block + 1) * block
            example = f"{lower} or {upper}" if lower else str(upper)
            report("ffn_hidden_size", f"{width} is not a multiple of {key('block_size')} ({block}), which "
                   f"the sparse backend needs; use a multiple of {block} (e.g. {example}) or "
                   f"{key('backend')}: grouped")
    if get("backend") == "grouped" and element_bytes and have("hidden_size", "ffn_hidden_size"):
        # torch's grouped_mm needs 16-byte row strides
        multiple = max(1, 16 // element_bytes)
        for field in ("hidden_size", "ffn_hidden_size"):
            shards = ffn_shards if field == "ffn_hidden_size" else 1
            if get(field) % shards:
                continue  # a width the expert-parallel ranks cannot split: reported by the caller
            size = get(field) // shards
            if size % multiple:
                report(field, f"{get(field)} gives rows of {size} elements, not a multiple of {multiple}, which "
                              f"{key('backend')}: grouped needs at this precision (16-byte rows); use a "
                              f"multiple of {multiple} or another {key('backend')}")
    return problems


def fused_router_unsupported(values: Dict[str, Any], key: Callable[[str], str] = lambda field: field):
    """Why the fused router kernels cannot route with these MoEOptions values (None: they can).
    They cover softmax scores with the top-k taken of the probabilities, without group-limited
    routing or expert bias, up to FUSED_ROUTER_MAX_EXPERTS experts."""
    get = values.get
    if get("score_function", "softmax") != "softmax":
        return f"{key('score_function')} {fmt(get('score_function'))} (softmax only)"
    if not get("pre_softmax", True):
        return f"{key('pre_softmax')} false (it takes the top-k of the probabilities)"
    if get("router_num_groups") is not None:
        return f"{key('router_num_groups')} {get('router_num_groups')} (no group-limited routing)"
    if get("expert_bias"):
        return f"{key('expert_bias')} true (no expert bias)"
    if (get("num_experts") or 0) > FUSED_ROUTER_MAX_EXPERTS:
        return f"{key('num_experts')} {get('num_experts')} (at most {FUSED_ROUTER_MAX_EXPERTS} experts)"
    return None


def _group_problems(values, key, have, report) -> None:
    """Group-limited routing: both numbers or neither; whole groups; enough experts in the chosen groups."""
    get = values.get
    groups, group_topk = get("router_num_groups"), get("router_group_topk")
    if "router_num_groups" in values and "router_group_topk" in values and (groups is None) != (group_topk is None):
        missing = "router_group_topk" if group_topk is None else "router_num_groups"
        given = "router_num_groups" if group_topk is None else "router_group_topk"
        report(missing, f"null while {key(given)} is {fmt(get(given))}; group-limited routing needs both "
                        f"(set {key(missing)}, or set {key(given)}: null)")
        return
    if groups is None or not have("router_num_groups", "router_group_topk"):
        return
    if have("num_experts") and get("num_experts") % groups:
        report("router_num_groups", f"{groups} does not divide {key('num_experts')} ({get('num_experts')}) "
                                    f"into equal groups; use a divisor of {get('num_experts')}")
        return
    if group_topk > groups:
        report("router_group_topk", f"{group_topk} is larger than {key('router_num_groups')} ({groups}); "
                                    f"use a value from 1 to {groups}")
        return
    if not have("top_k", "num_experts"):
        return
    top_k, per_group = get("top_k"), get("num_experts") // groups
    if group_topk * per_group < top_k:
        report("router_group_topk", f"{group_topk} groups of {per_group} experts cannot hold {key('top_k')} "
                                    f"({top_k}) experts; use at least {math.ceil(top_k / per_group)} groups")
        return
    if get("router_group_score", "sum") != "sum":
        return
    # megatron-core scores a group by the sum of its top (top_k // group_topk) experts
    if top_k % group_topk:
        report("router_group_topk", f"{group_topk} does not divide {key('top_k')} ({top_k}); each chosen "
                                    f"group is scored by its best top_k / group_topk experts; use a divisor "
                                    f"of {top_k}, or {key('router_group_score')}: max")


@dataclass
class MoEOptions:
    hidden_size: int
    ffn_hidden_size: int  # width of each expert's MLP
    num_experts: int
    top_k: int = 1
    activation: str = "gelu"  # gelu | swiglu (silu(x w1^T) * (x v1^T))
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = True  # softmax over all experts, then top-k (else top-k of logits, then softmax)
    renormalize: Optional[bool] = None  # top-k weights to sum 1; None = True for sigmoid with top_k > 1
    topk_scaling_factor: float = 1.0
    input_jitter_eps: Optional[float] = None  # router input * U(1-eps, 1+eps) in training
    aux_loss_coeff: float = 0.0  # load-balancing loss; 0 disables it
    z_loss_coeff: float = 0.0  # router z-loss; 0 disables it
    expert_bias: bool = False  # aux-loss-free balancing: a bias that changes the selection only
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None  # None = dropless; a number = token-dropping baseline
    token_drop_policy: str = "probs"  # probs | position
    backend: str = "auto"  # auto | sparse | grouped | reference (auto: sparse on CUDA, reference on CPU)
    block_size: int = 128  # block size of the sparse backend: one of BLOCK_SIZES
    memory_optimized: bool = False  # keep only the expert input and pre-activation; recompute the rest
    ep_exchange: str = "auto"  # expert parallelism: auto | nccl | symmetric (see moe/dispatch/expert_parallel.py)
    init_method_std: float = 0.02
    shared_expert_ffn_hidden_size: int = 0  # width of an MLP every token runs besides its experts; 0 = none
    shared_expert_gate: bool = False  # the shared MLP's output times sigmoid(x . g) per token
    aux_loss_type: str = "micro_batch"  # micro_batch | sequence | global: where expert fractions are counted
    router_num_groups: Optional[int] = None  # group-limited routing: experts in this many equal groups
    router_group_topk: Optional[int] = None  # ... of which each token picks this many, then top_k inside
    router_group_score: str = "sum"  # sum (of each group's best top_k / group_topk; megatron-core) | max
    router_impl: str = "auto"  # auto | fused | torch: see ROUTER_IMPLS

    def __post_init__(self):
        problems = option_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(f"MoE option '{field}'={getattr(self, field)!r}: {message}"
                                       for field, message in problems))
        if self.renormalize is None:
            self.renormalize = self.score_function == "sigmoid" and self.top_k > 1

    @classmethod
    def from_transformer_config(cls, config, **overrides) -> "MoEOptions":
        """Read megatron-core's own TransformerConfig MoE fields; `overrides` name MoEOptions fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(
                f"unknown MoE layer option(s) {unknown}; the layer accepts {sorted(names)}"
            )

        def unsupported(field, value, fix):
            raise ValueError(f"TransformerConfig.{field}={value!r} is not supported by this MoE layer; {fix}.")

        if not config.num_moe_experts:
            raise ValueError(
                "TransformerConfig.num_moe_experts is not set; set it (--num-experts) to build an MoE layer."
            )
        balancing = config.moe_router_load_balancing_type
        aux_coeff = config.moe_aux_loss_coeff
        if isinstance(aux_coeff, (list, tuple)):
            unsupported("moe_aux_loss_coeff", aux_coeff, "give one number")
        if balancing not in ("none", *AUX_LOSS_TYPES_MEGATRON):
            unsupported("moe_router_load_balancing_type", balancing,
                        f"use one of: none, {', '.join(AUX_LOSS_TYPES_MEGATRON)}")
        if getattr(config, "moe_shared_expert_overlap", False):
            unsupported("moe_shared_expert_overlap", True, "leave it False (the shared MLP is issued before "
                        "the expert exchange is waited on anyway)")
        values = dict(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            num_experts=config.num_moe_experts,
            top_k=config.moe_router_topk,
            activation=_activation_name(config),
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            topk_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
            input_jitter_eps=config.moe_input_jitter_eps,
            aux_loss_coeff=0.0 if balancing == "none" else float(aux_coeff or 0.0),
            z_loss_coeff=float(config.moe_z_loss_coeff or 0.0),
            expert_bias=config.moe_router_enable_expert_bias,
            bias_update_rate=config.moe_router_bias_update_rate,
            capacity_factor=config.moe_expert_capacity_factor,
            token_drop_policy=config.moe_token_drop_policy,
            init_method_std=config.init_method_std,
            shared_expert_ffn_hidden_size=getattr(config, "moe_shared_expert_intermediate_size", None) or 0,
            shared_expert_gate=bool(getattr(config, "moe_shared_expert_gate", False)),
            aux_loss_type=AUX_LOSS_TYPES_MEGATRON.get(balancing, "micro_batch"),
            router_num_groups=getattr(config, "moe_router_num_groups", None) or None,
            router_group_topk=getattr(config, "moe_router_group_topk", None) or None,
        )
        values.update(overrides)
        return cls(**values)


def _activation_name(config) -> str:
    func, gated = config.activation_func, config.gated_linear_unit
    if func is F.gelu and not gated:
        return "gelu"
    if func is F.silu and gated:
        if getattr(config, "glu_linear_offset", 0.0):
            raise ValueError(
                f"TransformerConfig.glu_linear_offset={config.glu_linear_offset} is not supported by the "
                "MoE experts; leave it at 0."
            )
        return "swiglu"
    name = getattr(func, "__name__", repr(func))
    raise ValueError(
        f"TransformerConfig.activation_func={name} with gated_linear_unit={gated} is not supported by the "
        "MoE experts; use F.gelu without gating (GELU) or F.silu with gated_linear_unit=True (SwiGLU)."
    )
