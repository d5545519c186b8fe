"""Expert weight gradients once per window of micro-batches (WgradStash.use_window,
moe.expert_wgrad_window): main_grad is left alone until a window is full, then holds what the
per-micro-batch accumulation gives, for both autograd functions, both activations, with and
without the memory-optimised recompute; a new step (main_grads_zeroed) starts a new window.

On CPU the kernels run through Triton's interpreter (fp32, fp16)."""
import pytest
import torch

from megatron_dmoe.moe.experts.per_step_wgrad import WgradStash
from test_fused_wgrad import CASES, DEAD, HIDDEN, T, _backward, _leaf_params, _problem, _rel

MICRO_BATCHES = (31, 32, 33, 34)  # seeds: a different routing per micro-batch, expert DEAD never routed


def _run(kind, activation, memory_optimized, dtype, params, window, device="cpu"):
    """Backward of every micro-batch into params' main_grad; returns the input gradients and, after
    each micro-batch, whether main_grad had changed."""
    stash = WgradStash()
    stash.use_window(window)  # main_grad is not zeroed here: a window must add, never overwrite
    input_grads, changed = [], []
    for seed in MICRO_BATCHES:
        x_in, state, _ = _problem(seed, activation, dtype, device, kind=kind)
        rows = T if kind == "combine" else x_in.shape[0]
        out_grad = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed + 100))
        before = [None if p is None else p.main_grad.clone() for p in params]
        input_grads.append(_backward(kind, x_in, state, params, activation, out_grad, memory_optimized, stash)[1])
        changed.append(any(p is not None and not torch.equal(p.main_grad, b) for p, b in zip(params, before)))
    return input_grads, changed


@pytest.mark.parametrize("kind, activation, memory_optimized, dtype", CASES,
                         ids=[f"{k}-{a}-{'memopt-' if m else ''}{str(d)[6:]}" for k, a, m, d in CASES])
@pytest.mark.slow
def test_windows_of_two_equal_one_product_per_micro_batch(kind, activation, memory_optimized, dtype):
    _, _, weights = _problem(30, activation, dtype)
    per_micro = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    windowed = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    dx_micro, _ = _run(kind, activation, memory_optimized, dtype, per_micro, 1)
    dx_window, changed = _run(kind, activation, memory_optimized, dtype, windowed, 2)
    assert changed == [False, True, False, True]
    for a, b in zip(dx_window, dx_micro):
        assert torch.equal(a, b)  # windows touch weight gradients only
    for name, p, q in zip(("w1", "v1", "w2"), windowed, per_micro):
        if p is not None:
            assert p.grad is None, name
            assert _rel(p.main_grad, q.main_grad) < 1e-6, name  # fp32 sums in another order
            assert torch.equal(p.main_grad[DEAD], q.main_grad[DEAD]), name


def test_a_new_step_starts_a_new_window():
    """main_grads_zeroed() (the loop's start of a step) drops a window left unfinished."""
    _, _, weights = _problem(30, "gelu", torch.float32)
    params = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    start = [None if p is None else p.main_grad.clone() for p in params]
    stash = WgradStash()
    stash.use_window(2)
    for seed in (31, 32):
        stash.main_grads_zeroed()
        x_pad, state, _ = _problem(seed, "gelu", torch.float32)
        _backward("expert_mlp", x_pad, state, params, "gelu", torch.randn(x_pad.shape[0], HIDDEN), False, stash)
    assert all(p is None or torch.equal(p.main_grad, s) for p, s in zip(params, start))
    assert stash.window_bytes() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind, activation", [("combine", "gelu"), ("expert_mlp", "swiglu")])
def test_windows_in_bf16_on_the_gpu(kind, activation):
    _, _, weights = _problem(30, activation, torch.bfloat16, "cuda")
    per_micro = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    windowed = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    _run(kind, activation, False, torch.bfloat16, per_micro, 1, "cuda")
    _, changed = _run(kind, activation, False, torch.bfloat16, windowed, 4, "cuda")
    assert changed == [False, False, False, True]
    for name, p, q in zip(("w1", "v1", "w2"), windowed, per_micro):
        if p is not None:
            assert _rel(p.main_grad, q.main_grad) < 1e-5, name  # bf16 products, fp32 sums
