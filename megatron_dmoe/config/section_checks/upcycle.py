"""checkpoint.upcycle_from with moe.upcycle_granularity: an MoE run upcycled from a dense one."""
from __future__ import annotations

from megatron_dmoe.parallel.layout_rules import TP_KEY

from .state import CheckState


def check(state: CheckState) -> None:
    """checkpoint.upcycle_from and moe.upcycle_granularity: an MoE run whose experts can hold
    the dense MLP's pieces (the dense checkpoint itself is read when the run starts)."""
    v, ok = state.v, state.ok
    key, gran_key = "checkpoint.upcycle_from", "moe.upcycle_granularity"
    source = v(key) if ok(key) else None
    if not source:
        if ok(gran_key) and v(gran_key) != 1:
            state.problem(gran_key, f"{v(gran_key)} applies only to upcycling, but {key} is not set; set "
                          f"{key} or leave {gran_key} at 1")
        return
    if ok("checkpoint.load") and v("checkpoint.load"):
        state.problem(key, f"{source!r} and checkpoint.load ({v('checkpoint.load')!r}) both initialise the "
                      f"weights; keep one of them")
    if not ok("moe.num_experts") or v("moe.num_experts") == 0:
        if ok("moe.num_experts"):
            state.problem(key, f"{source!r} needs MoE layers to upcycle into, but moe.num_experts is 0; "
                          f"set moe.num_experts")
        return
    if ok(TP_KEY) and v(TP_KEY) > 1:
        state.problem(key, f"{source!r} with {TP_KEY} {v(TP_KEY)}: upcycling copies whole dense MLPs into "
                      f"the experts, at tensor-parallel size 1 only; set {TP_KEY}: 1")
    if not ok(gran_key, "model.ffn_hidden_size", "moe.ffn_hidden_size"):
        return
    n, dense, width, experts = (v(gran_key), v("model.ffn_hidden_size"), v("moe.ffn_hidden_size"),
                                v("moe.num_experts"))
    if dense % n:
        state.problem(gran_key, f"{n} does not divide model.ffn_hidden_size ({dense}); use a divisor of {dense}")
    elif width != dense // n:
        state.problem("moe.ffn_hidden_size", f"{width} is not model.ffn_hidden_size / {gran_key} "
                      f"({dense} / {n} = {dense // n}), the width of each piece of the dense MLP; set "
                      f"moe.ffn_hidden_size: {dense // n}")
    if experts % n:
        state.problem(gran_key, f"{n} does not divide moe.num_experts ({experts}): every copy of the dense "
                      f"MLP is split into {n} experts; use a multiple of {n} experts")
