"""The MoE layer's rules: MoEOptions obeys them and the configuration check
(config/section_checks/moe.py) reports them for a run configuration (under its YAML keys, through
`option_problems(values, key=...)`)."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from .moe_settings import MOE_SETTINGS
from .value_text import fmt, range_text

FUSED_ROUTER_MAX_EXPERTS = 256  # dmoe_kernels.router.ops.MAX_EXPERTS

# option: allowed values / (lowest, highest, lowest allowed?, highest allowed?)
CHOICES = {s.option: s.choices for s in MOE_SETTINGS if s.option and s.choices}
RANGES = {s.option: s.limits for s in MOE_SETTINGS if s.option and s.limits}
_INTEGERS = {s.option for s in MOE_SETTINGS if s.option and s.integer}


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
    (field, message) with other fields named by `key(field)` (the configuration check passes YAML keys).

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
    if get("fp8") is not None and "fp8" not in bad:
        if get("backend") in ("grouped", "reference"):
            report("fp8", f"{fmt(get('fp8'))} runs the experts' products as block-sparse fp8 kernels, which "
                          f"{key('backend')}: {get('backend')} does not have; set {key('backend')}: sparse "
                          f"(or auto) or {key('fp8')}: null")
        elif get("capacity_factor") is not None:
            report("fp8", f"{fmt(get('fp8'))} is for the dropless experts; the token-dropping baseline "
                          f"({key('capacity_factor')} {fmt(get('capacity_factor'))}) runs in bf16; set "
                          f"{key('capacity_factor')}: null or {key('fp8')}: null")
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
