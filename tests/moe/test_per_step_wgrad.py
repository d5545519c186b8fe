"""Expert weight gradients once per step (moe/experts/per_step_wgrad.py): inside
WgradStash.per_step() the sparse experts' backward leaves main_grad alone and the block's
exit adds all micro-batches' gradients in one product per weight; the sum must equal the
per-micro-batch accumulation (and so the float64 sum of the separate gradients), for both autograd
functions, both activations, with and without the memory-optimised recompute.

On CPU the kernels run through Triton's interpreter (fp32, fp16)."""
import pytest
import torch

from megatron_dmoe.moe.experts.per_step_wgrad import WgradStash
from test_fused_wgrad import CASES, DEAD, HIDDEN, T, _backward, _leaf_params, _problem, _rel

MICRO_BATCHES = (31, 32, 33)  # seeds: a different routing per micro-batch, expert DEAD never routed


def _micro_batch_grads(kind, activation, memory_optimized, dtype, params, per_step, device="cpu"):
    """Backward of every micro-batch into params' main_grad; returns the input gradients."""
    input_grads = []
    stash = WgradStash()
    with stash.per_step(enabled=per_step):
        for seed in MICRO_BATCHES:
            x_in, state, _ = _problem(seed, activation, dtype, device, kind=kind)
            rows = T if kind == "combine" else x_in.shape[0]
            out_grad = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed + 100))
            before = [None if p is None else p.main_grad.clone() for p in params]
            input_grads.append(_backward(kind, x_in, state, params, activation, out_grad, memory_optimized,
                                         stash)[1])
            if per_step:  # deferred: nothing reaches main_grad before the block ends
                assert all(p is None or torch.equal(p.main_grad, b) for p, b in zip(params, before))
    return input_grads


@pytest.mark.parametrize("kind, activation, memory_optimized, dtype", CASES,
                         ids=[f"{k}-{a}-{'memopt-' if m else ''}{str(d)[6:]}" for k, a, m, d in CASES])
@pytest.mark.slow
def test_one_product_per_step_equals_one_per_micro_batch(kind, activation, memory_optimized, dtype):
    _, _, weights = _problem(30, activation, dtype)
    per_micro = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    per_step = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    dx_micro = _micro_batch_grads(kind, activation, memory_optimized, dtype, per_micro, per_step=False)
    dx_step = _micro_batch_grads(kind, activation, memory_optimized, dtype, per_step, per_step=True)
    for a, b in zip(dx_step, dx_micro):
        assert torch.equal(a, b)  # deferral touches weight gradients only
    for name, p, q in zip(("w1", "v1", "w2"), per_step, per_micro):
        if p is not None:
            assert p.grad is None, name
            assert _rel(p.main_grad, q.main_grad) < 1e-6, name  # fp32 sums in another order
            assert torch.equal(p.main_grad[DEAD], q.main_grad[DEAD]), name


@pytest.mark.gpu
@pytest.mark.parametrize("kind, activation", [("combine", "gelu"), ("expert_mlp", "swiglu")])
def test_one_product_per_step_in_bf16_on_the_gpu(kind, activation):
    _, _, weights = _problem(30, activation, torch.bfloat16, "cuda")
    per_micro = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    per_step = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    _micro_batch_grads(kind, activation, False, torch.bfloat16, per_micro, False, "cuda")
    _micro_batch_grads(kind, activation, False, torch.bfloat16, per_step, True, "cuda")
    for name, p, q in zip(("w1", "v1", "w2"), per_step, per_micro):
        if p is not None:
            assert _rel(p.main_grad, q.main_grad) < 1e-5, name  # bf16 products, fp32 sums


def test_an_exception_in_the_step_drops_the_deferred_gradients():
    _, _, weights = _problem(30, "gelu", torch.float32)
    params = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    start = [None if p is None else p.main_grad.clone() for p in params]
    stash = WgradStash()
    with pytest.raises(RuntimeError, match="boom"):
        with stash.per_step():
            x_pad, state, _ = _problem(31, "gelu", torch.float32)
            _backward("expert_mlp", x_pad, state, params, "gelu", torch.randn(x_pad.shape[0], HIDDEN), False, stash)
            raise RuntimeError("boom")
    assert all(p is None or torch.equal(p.main_grad, s) for p, s in zip(params, start))
    # the next step starts clean: without the block, gradients go straight in again
    x_pad, state, _ = _problem(32, "gelu", torch.float32)
    _backward("expert_mlp", x_pad, state, params, "gelu", torch.randn(x_pad.shape[0], HIDDEN), False, stash)
    assert not torch.equal(params[0].main_grad, start[0])


def test_blocks_do_not_nest():
    stash = WgradStash()
    with stash.per_step():
        with pytest.raises(RuntimeError, match="nested"):
            with stash.per_step():
                pass
