"""parallel.*: the legal parallel layouts (parallel/layout_rules.py) for this model and world size."""
from __future__ import annotations

from megatron_dmoe.parallel import layout_rules
from megatron_dmoe.parallel.layout_rules import CP_KEY, EP_KEY, ETP_KEY, PP_KEY, SP_KEY, TP_KEY, VPP_KEY

from ..moe_layers import moe_layer_pattern
from ..overlap_rules import BUCKET_KEY, DISTOPT_KEY, GRAD_KEY, OVERLAP_RULE_KEYS, PARAM_KEY, grad_overlap_refusals
from .state import CheckState

# The keys the parallel layout's rules read; the checks pass the valid ones.
LAYOUT_KEYS = (TP_KEY, PP_KEY, VPP_KEY, EP_KEY, ETP_KEY, CP_KEY, SP_KEY, "model.num_layers",
               "model.num_attention_heads", "model.num_query_groups", "model.seq_length",
               "model.ffn_hidden_size", "moe.num_experts", "moe.ffn_hidden_size", "moe.expert_capacity_factor",
               "training.micro_batch_size", "training.global_batch_size",
               "moe.expert_wgrad_window")


def check_layout(state: CheckState) -> None:
    """How the model splits over the parallel sizes (parallel/layout_rules.py)."""
    problems = layout_rules.model_split_problems(_layout_values(state), has_dense_mlp=_has_dense_mlp(state))
    for key, message in problems:
        state.problem(key, message)


def check_world_size(state: CheckState) -> None:
    """How the parallel and batch sizes fit the world size (parallel/layout_rules.py)."""
    for key, message in layout_rules.world_size_problems(_layout_values(state), state.world_size):
        state.problem(key, message)


def _layout_values(state: CheckState) -> dict:
    return {key: state.v(key) for key in LAYOUT_KEYS if state.ok(key)}


def _has_dense_mlp(state: CheckState) -> bool:
    """Does any layer have megatron's dense MLP (model.ffn_hidden_size, split over TP)?"""
    v, ok = state.v, state.ok
    if not ok("moe.num_experts", "moe.layer_freq", "moe.first_dense_layers", "model.num_layers"):
        return True
    if v("moe.num_experts") == 0:
        return True
    return not all(moe_layer_pattern(v("model.num_layers"), v("moe.layer_freq"), v("moe.first_dense_layers")))


def check_overlap(state: CheckState) -> None:
    """`true` only where overlapping the data-parallel communication is correct
    (config/overlap_rules.py); `auto` is resolved at start-up, off where it is not."""
    v, ok = state.v, state.ok
    if ok(GRAD_KEY) and v(GRAD_KEY) is True:
        values = {k: v(k) for k in OVERLAP_RULE_KEYS if ok(k)}
        for why, fix in grad_overlap_refusals(values):
            state.problem(GRAD_KEY, f"true cannot overlap the gradient reduction: {why}; {fix}, or set "
                          f"{GRAD_KEY}: false")
    if ok(PARAM_KEY) and v(PARAM_KEY) is True:
        # Megatron-LM's rule: the gather of the sharded parameters follows the sharded reduction
        if ok(DISTOPT_KEY) and not v(DISTOPT_KEY):
            state.problem(PARAM_KEY, f"true needs {DISTOPT_KEY}: true (only the distributed optimizer "
                          f"gathers parameters); set it, or set {PARAM_KEY}: false")
        if ok(GRAD_KEY) and v(GRAD_KEY) is not True:
            state.problem(PARAM_KEY, f"true needs {GRAD_KEY}: true (as Megatron-LM's "
                          f"--overlap-param-gather needs --overlap-grad-reduce); set it, or set {PARAM_KEY}: auto")
    if ok(BUCKET_KEY, GRAD_KEY) and state.raw(BUCKET_KEY) is not None and v(GRAD_KEY) is False:
        state.problem(BUCKET_KEY, f"is used only when gradients are reduced in overlap ({GRAD_KEY}: true "
                      f"or auto); set it to null, or {GRAD_KEY}: true")
