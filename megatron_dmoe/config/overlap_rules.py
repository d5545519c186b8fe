"""Where data-parallel communication may overlap the backward and forward passes
(`parallel.overlap_grad_reduce`, `parallel.overlap_param_gather`: megatron-core's DDP buckets).

One set of rules serves two uses, as for CUDA graphs: `validate` refuses `true` where overlap is not
correct, and `resolve_overlap` turns `auto` (the default) into true or false once, at start-up, with
one note naming the reason where a GPU run with data-parallel ranks keeps it off.
"""
from __future__ import annotations

import copy
from typing import Any, List, Mapping, Optional, Tuple

GRAD_KEY = "parallel.overlap_grad_reduce"
PARAM_KEY = "parallel.overlap_param_gather"
BUCKET_KEY = "parallel.ddp_bucket_size"
DISTOPT_KEY = "training.use_distributed_optimizer"
# the keys the rules read; validate passes those whose values are valid
OVERLAP_RULE_KEYS = ("training.cuda_graphs", "moe.num_experts", "moe.expert_wgrad_per_step", "moe.expert_wgrad_window")


def grad_overlap_refusals(values: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """(why the gradients cannot be reduced during backward, what to change) for these settings;
    `values` maps OVERLAP_RULE_KEYS to their values (a key left out is not checked)."""
    get = values.get
    found = []
    if get("training.cuda_graphs") is True:
        # DDP's gradient-ready hooks return at once while a graph is captured; on replay the weight
        # gradients come out of the graph's backward, an order of hooks no run has checked yet
        found.append(("captured layers (training.cuda_graphs: true) have not been shown to reduce their "
                      "gradients correctly in overlap", "set training.cuda_graphs: false"))
    if (get("moe.num_experts") or 0) > 0:
        if get("moe.expert_wgrad_per_step"):
            found.append(("moe.expert_wgrad_per_step: true adds the expert weight gradients after the "
                          "last backward, when their buckets would already be reduced",
                          "set moe.expert_wgrad_per_step: false"))
        window = get("moe.expert_wgrad_window")
        if isinstance(window, int) and window > 1:  # auto takes 1 where overlap is asked for
            found.append(("moe.expert_wgrad_window > 1 adds the expert weight gradients at the window's "
                          "end, after their buckets' hooks", "set moe.expert_wgrad_window: 1"))
    return found


def data_parallel_sizes(world_size: int, tp: int, pp: int, ep: int, etp: int) -> Tuple[int, int]:
    """(data-parallel size of the dense parameters, of the expert parameters)."""
    return max(world_size // (tp * pp), 1), max(world_size // (ep * etp * pp), 1)


def resolve_overlap(cfg, cuda: bool, world_size: int, local_world_size: Optional[int] = None
                    ) -> Tuple[Any, List[str]]:
    """``cfg`` with `auto` replaced by true or false in both keys, and the note saying why overlap
    stays off on a GPU run whose gradients cross hosts. `cfg` is resolved and valid, and its
    training.cuda_graphs already true or false. local_world_size: processes per host (None: all
    of them, one host).

    auto is on for CUDA runs on more than one host whose gradients are reduced over more than one
    rank (dense or expert data-parallel), where the rules allow it; the parameter gather with it
    where the distributed optimizer shards the parameters. On one host the reduction after backward
    costs little over NVLink and the buckets' overlap measured slower (docs/performance.md), so
    auto keeps it off there, quietly. CPU runs keep both off: gloo reduces on the CPU cores the
    backward computes on, so there is nothing to overlap with.
    """
    par = cfg.parallel
    if par.overlap_grad_reduce != "auto" and par.overlap_param_gather != "auto":
        return cfg, []
    out = copy.deepcopy(cfg)
    on_cuda = cuda and cfg.training.device != "cpu"
    dense_dp, expert_dp = data_parallel_sizes(world_size, par.tensor_model_parallel_size,
                                              par.pipeline_model_parallel_size, par.expert_model_parallel_size,
                                              par.expert_tensor_parallel_size)
    why: Optional[str] = None
    if par.overlap_grad_reduce == "auto":
        refusals = grad_overlap_refusals({key: _value(cfg, key) for key in OVERLAP_RULE_KEYS})
        if not on_cuda:
            why = "a CPU run"
        elif dense_dp == 1 and (cfg.moe.num_experts == 0 or expert_dp == 1):
            why = "no gradient is reduced over ranks"
        elif (local_world_size or world_size) >= world_size:
            why = "one host"
        elif refusals:
            why = refusals[0][0]
        out.parallel.overlap_grad_reduce = why is None
    if par.overlap_param_gather == "auto":
        out.parallel.overlap_param_gather = bool(out.parallel.overlap_grad_reduce is True
                                                 and cfg.training.use_distributed_optimizer)
    quiet = not on_cuda or why in ("no gradient is reduced over ranks", "one host")
    notes = [] if why is None or quiet else [
        f"note: {GRAD_KEY}: auto reduces the gradients after backward here: {why} ({GRAD_KEY}=false)"]
    return out, notes


def with_overlap_as_asked(cfg, asked):
    """`cfg` with both overlap keys as `asked` says them (auto stays auto)."""
    if (cfg.parallel.overlap_grad_reduce, cfg.parallel.overlap_param_gather) == (
            asked.parallel.overlap_grad_reduce, asked.parallel.overlap_param_gather):
        return cfg
    out = copy.deepcopy(cfg)
    out.parallel.overlap_grad_reduce = asked.parallel.overlap_grad_reduce
    out.parallel.overlap_param_gather = asked.parallel.overlap_param_gather
    return out


def _value(cfg, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
