"""training.*: the schedule, precision and device, CUDA graphs, and the MoE options whose effect
depends on them (the exchanges through GPU memory, per-step expert weight gradients)."""
from __future__ import annotations

from megatron_dmoe.parallel.layout_rules import EP_KEY

from ..cuda_graphs_rules import RULE_KEYS, capture_refusals
from ..nvshmem_rows import row_bytes_problem
from ..value_text import fmt
from .state import CheckState

# runs shorter than this are checks that a setup runs, not schedules: no warning about the warmup
SCHEDULE_WARNING_ITERS = 100


def check(state: CheckState) -> None:
    v, ok = state.v, state.ok
    if ok("training.lr", "training.min_lr") and v("training.min_lr") > v("training.lr"):
        state.problem("training.min_lr", f"{fmt(v('training.min_lr'))} is larger than "
                      f"training.lr ({fmt(v('training.lr'))}); use a value from 0 to "
                      f"{fmt(v('training.lr'))}")
    warmup_key, decay_key = "training.lr_warmup_iters", "training.lr_decay_iters"
    # A warmup as long as the run is allowed (the rate is still rising when the run ends, as
    # Megatron-LM allows); the scheduler then decays after it, past the run's end. A warning only for
    # a run long enough to be meant to learn: a check of a few steps keeps its config's warmup.
    if ok(warmup_key, decay_key, "training.train_iters"):
        warmup, decay, iters = v(warmup_key), v(decay_key), v("training.train_iters")
        if warmup >= iters and decay >= iters:
            if iters >= SCHEDULE_WARNING_ITERS:
                state.warn(warmup_key, f"{warmup} is not shorter than training.train_iters ({iters}): "
                           f"the learning rate is still rising when the run ends and never decays; "
                           f"use fewer warmup iterations for a full schedule")
        elif decay <= warmup:  # a decay that ends within the run must outlast the warmup
            state.problem(decay_key, f"{decay} is not larger than {warmup_key} ({warmup}); use "
                          f"more than {warmup}, or null (= train_iters)")
    _check_wsd(state)
    if ok("training.bf16", "training.fp16") and v("training.bf16") and v("training.fp16"):
        state.problem("training.fp16", "true together with training.bf16: true; choose one")
    if ok("training.loss_scale", "training.fp16") and not v("training.fp16") \
            and state.raw("training.loss_scale") is not None:
        state.problem("training.loss_scale", "is used only with training.fp16: true; set it to "
                      "null or enable fp16")
    if ok("training.eval_interval", "training.eval_iters") and v("training.eval_interval") > 0 \
            and v("training.eval_iters") == 0:
        state.problem("training.eval_iters", f"0 with training.eval_interval "
                      f"{v('training.eval_interval')} would evaluate nothing; use at least 1, "
                      f"or training.eval_interval: 0 to disable evaluation")
    if ok("training.device") and v("training.device") == "cuda" and not state.env.cuda:
        state.problem("training.device", "'cuda' but CUDA is not available here; use auto or "
                      "cpu")
    _check_cuda_graphs(state)
    _check_ep_exchange(state)
    _check_expert_wgrad_per_step(state)
    _check_expert_wgrad_window(state)

    for key in ("training.bf16", "training.fp16"):
        if ok(key, "training.device") and v(key):
            device = v("training.device")
            if device == "cpu" or (device == "auto" and not state.env.cuda):
                state.problem(key, "true needs CUDA (megatron-core's mixed-precision optimizer "
                              "keeps fp32 master weights on the GPU); on CPU train in fp32 "
                              "(set it to false)")


def _check_wsd(state: CheckState) -> None:
    """WSD's decay phase: given with WSD only, and inside the decay after the warmup."""
    v, ok, key = state.v, state.ok, "training.lr_wsd_decay_iters"
    if not ok(key, "training.lr_decay_style"):
        return
    if v("training.lr_decay_style") != "WSD":
        if state.raw(key) is not None:
            state.problem(key, f"is used only with training.lr_decay_style: WSD (here "
                          f"{v('training.lr_decay_style')}); set it to null, or the style to WSD")
        return
    if v(key) is None:
        state.problem(key, "is needed with training.lr_decay_style: WSD: how many of the last steps of the "
                      "decay fall from training.lr to training.min_lr (e.g. a tenth of training.train_iters)")
    elif ok("training.lr_decay_iters", "training.lr_warmup_iters") and \
            v(key) > v("training.lr_decay_iters") - v("training.lr_warmup_iters"):
        stable = v("training.lr_decay_iters") - v("training.lr_warmup_iters")
        state.problem(key, f"{v(key)} is longer than the decay after the warmup (training.lr_decay_iters "
                      f"{v('training.lr_decay_iters')} - training.lr_warmup_iters {v('training.lr_warmup_iters')} "
                      f"= {stable}); use at most {stable}")


def _check_cuda_graphs(state: CheckState) -> None:
    """`true` only where capture is correct (config/cuda_graphs_rules.py); `auto` is resolved
    at start-up instead, off with a note where it is not."""
    key = "training.cuda_graphs"
    if not state.ok(key) or state.v(key) is not True:
        return
    values = {k: state.v(k) for k in RULE_KEYS if state.ok(k)}
    for why, fix in capture_refusals(values, state.env.cuda, state.env.transformer_engine):
        state.problem(key, f"true cannot be captured: {why}; {fix}")


def _expert_backend_here(state: CheckState) -> str:
    """moe.backend, with auto as it resolves without CUDA (reference); callers checked it is valid."""
    v, ok = state.v, state.ok
    backend = v("moe.backend")
    if backend == "auto" and (not state.env.cuda or (ok("training.device") and v("training.device") == "cpu")):
        return "reference"
    return backend


def _check_expert_wgrad_per_step(state: CheckState) -> None:
    """Only the sparse backend defers its weight gradients, and a captured graph replays the
    per-micro-batch accumulation: refuse a setting that would silently do nothing."""
    v, ok, key = state.v, state.ok, "moe.expert_wgrad_per_step"
    if not ok(key, "moe.num_experts", "moe.backend") or not v(key) or v("moe.num_experts") == 0:
        return
    backend = _expert_backend_here(state)
    if backend in ("grouped", "reference"):
        state.problem(key, f"true needs the sparse expert backend, but moe.backend is {v('moe.backend')} "
                      f"(here: {backend}); set moe.backend: sparse, or set {key}: false")
    if ok("training.cuda_graphs") and v("training.cuda_graphs") is True:
        state.problem(key, "true has no effect with training.cuda_graphs: true (the captured layers "
                      "accumulate per micro-batch); set one of them to false, or use "
                      "moe.expert_wgrad_window, which captured layers hold")


def _check_expert_wgrad_window(state: CheckState) -> None:
    """Windows are the sparse backend's, and exclude the per-step deferral (which covers the step)."""
    v, ok, key = state.v, state.ok, "moe.expert_wgrad_window"
    # auto takes a window only where one applies (training/wgrad_window_auto.py)
    if not ok(key, "moe.num_experts", "moe.backend") or v(key) in (1, "auto") or v("moe.num_experts") == 0:
        return
    backend = _expert_backend_here(state)
    if backend in ("grouped", "reference"):
        state.problem(key, f"{v(key)} needs the sparse expert backend, but moe.backend is {v('moe.backend')} "
                      f"(here: {backend}); set moe.backend: sparse, or set {key}: 1")
    if ok("moe.expert_wgrad_per_step") and v("moe.expert_wgrad_per_step"):
        state.problem(key, f"{v(key)} and moe.expert_wgrad_per_step: true both defer the expert weight "
                      f"gradients; keep one ({key}: 1 or moe.expert_wgrad_per_step: false)")


def _check_ep_exchange(state: CheckState) -> None:
    """The symmetric and NVSHMEM exchanges move rows through GPU memory mapped between ranks: CUDA only."""
    v, ok, key = state.v, state.ok, "moe.ep_exchange"
    if not ok(key) or v(key) not in ("symmetric", "nvshmem"):
        return
    if (ok("training.device") and v("training.device") == "cpu") or not state.env.cuda:
        how = ("stores rows straight into peer GPUs' memory" if v(key) == "symmetric"
               else "moves rows between GPUs' symmetric memory")
        state.problem(key, f"{v(key)} needs CUDA GPUs (it {how}); use auto or nccl")
    elif v(key) == "nvshmem" and ok("model.hidden_size", EP_KEY, "training.bf16", "training.fp16") and v(EP_KEY) > 1:
        element_bytes = 2 if v("training.bf16") or v("training.fp16") else 4
        problem = row_bytes_problem(v("model.hidden_size") * element_bytes, v(EP_KEY))
        if problem is not None:
            state.problem(key, f"nvshmem: {problem}")
