"""The fused softmax top-k router against float64 torch: softmax -> topk -> gather (-> renormalise,
scale), the column sums of the probabilities, and the gradients through all of them.

On CPU the kernels run through Triton's interpreter (fp32 logits); on a GPU the same tests run
compiled. T is never a multiple of the kernels' row block (64 rows for E <= 64, 16 for E = 160).
"""
import zlib

import pytest
import torch

from dmoe_kernels.router import ops as router_ops
from dmoe_kernels.router.functional import fused_route

T = 77


def _logits(T, E, seed_key, device):
    """fp32 logits whose entries in a row are at least 2/E apart: no ties, even after softmax's
    rounding, so torch.topk's order is unambiguous."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_key).encode()))
    ranks = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).double()
    jitter = 0.5 * torch.rand(T, E, generator=g, dtype=torch.float64)
    return (6.0 * (ranks + jitter) / E - 3.0).float().to(device)


def _reference(logits, k, renormalize, scale, valid=None):
    """float64 torch autograd graph of what the kernels compute."""
    probs = torch.softmax(logits, dim=-1)
    top, indices = torch.topk(probs, k, dim=-1)
    weights = probs.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scale
    kept = probs if valid is None else probs * valid[:, None].to(probs.dtype)
    return indices, weights, probs, kept.sum(dim=0)


def _err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("E", [8, 64, 160])
@pytest.mark.slow
def test_fused_route_matches_torch_values_and_gradients(E, k, renormalize, device):
    logits = _logits(T, E, (E, k, renormalize), device).requires_grad_()
    ref_logits = logits.detach().double().requires_grad_()
    indices, weights, scores, colsum = fused_route(logits, k, renormalize)
    ref_indices, ref_weights, ref_scores, ref_colsum = _reference(ref_logits, k, renormalize, 1.0)
    assert indices.dtype == torch.int64 and tuple(indices.shape) == (T, k)
    assert torch.equal(indices.cpu(), ref_indices.cpu())
    # and equal to torch.topk of torch's own fp32 softmax (the layer's torch path)
    assert torch.equal(indices.cpu(), torch.topk(torch.softmax(logits.detach().cpu(), -1), k).indices)
    for got, want in ((weights, ref_weights), (scores, ref_scores), (colsum, ref_colsum)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert _err(got, want) < 1e-6
    # a random linear function of (weights, colsum): the load-balancing loss reads colsum, the combine weights
    g = torch.Generator().manual_seed(E * 100 + k)
    a = torch.randn(T, k, generator=g, dtype=torch.float64).to(device)
    b = torch.randn(E, generator=g, dtype=torch.float64).to(device)
    (got,) = torch.autograd.grad((weights * a.float()).sum() + (colsum * b.float()).sum(), logits)
    (want,) = torch.autograd.grad((ref_weights * a).sum() + (ref_colsum * b).sum(), ref_logits)
    assert got.dtype == torch.float32 and _err(got, want) < 1e-5


def test_fused_route_scale_padding_mask_and_each_gradient_alone(device):
    """topk_scaling_factor, a padding mask (colsum over valid tokens only, its gradient to those
    only), the scores' own gradient, and backward with only one of the three gradients present."""
    E, k, scale = 24, 3, 2.5
    logits = _logits(T, E, "mask", device).requires_grad_()
    ref_logits = logits.detach().double().requires_grad_()
    valid = (torch.arange(T) % 5 != 2).to(device)
    out = fused_route(logits, k, True, scale, valid)
    ref = _reference(ref_logits, k, True, scale, valid)
    assert torch.equal(out[0].cpu(), ref[0].cpu())
    for got, want in zip(out[1:], ref[1:]):
        assert _err(got, want) < 1e-6
    g = torch.Generator().manual_seed(5)
    coeffs = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(device) for t in ref[1:]]
    for used in ([0], [1], [2], [0, 1, 2]):  # weights, scores, colsum
        got_loss = sum((out[1 + i] * coeffs[i].float()).sum() for i in used)
        want_loss = sum((ref[1 + i] * coeffs[i]).sum() for i in used)
        (got,) = torch.autograd.grad(got_loss, logits, retain_graph=True)
        (want,) = torch.autograd.grad(want_loss, ref_logits, retain_graph=True)
        assert _err(got, want) < 1e-5, used


def test_fused_route_ties_nan_and_bad_arguments(device):
    """Equal logits: the lowest expert indices, in order (torch.topk on CPU returns tied entries in
    no fixed order). A NaN logit ranks first, as in torch.topk; every index stays a real expert."""
    E, k = 40, 5
    logits = torch.zeros(3, E, device=device)
    logits[1, 7] = float("nan")
    logits[2, 30:] = 1.0
    indices, weights, scores, colsum = router_ops.route_forward(logits, k)
    assert indices[0].tolist() == [0, 1, 2, 3, 4]
    assert indices[1, 0].item() == 7 and 0 <= int(indices.min()) and int(indices.max()) < E
    assert indices[2].tolist() == [30, 31, 32, 33, 34]
    assert torch.allclose(weights[0], torch.full((k,), 1.0 / E, device=device))
    for bad, message in ((lambda: router_ops.route_forward(logits.double(), k), "fp32"),
                         (lambda: router_ops.route_forward(logits, E + 1), "top_k"),
                         (lambda: router_ops.route_forward(torch.zeros(2, 300, device=device), 2), "300 experts"),
                         (lambda: router_ops.route_forward(logits, k, valid=torch.ones(2, dtype=torch.bool)),
                          "valid")):
        with pytest.raises(ValueError, match=message):
            bad()


@pytest.mark.parametrize("E,counts_dtype", [(8, torch.int64), (60, torch.int32), (256, torch.int64)])
def test_balance_loss_value_gradient_and_running_sums(E, counts_dtype, device):
    from dmoe_kernels.router.functional import balance_loss

    colsum = torch.rand(E, device=device, dtype=torch.float32).requires_grad_()
    counts = torch.randint(0, 50, (E,), device=device, dtype=counts_dtype)
    scale = 0.01 * E / (2 * 37.0**2)
    want = scale * (counts.double() * colsum.detach().double()).sum()
    lb_sum = torch.full((), 0.5, dtype=torch.float64, device=device)
    lb_count = torch.full((), 2.0, dtype=torch.float64, device=device)
    load = torch.randint(0, 9, (E,), device=device, dtype=counts_dtype)
    load_before = load.clone()
    loss = balance_loss(colsum, counts, scale, record=(lb_sum, lb_count, load))
    assert loss.shape == () and loss.dtype == torch.float32
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float(lb_sum) == pytest.approx(0.5 + float(want), rel=1e-5) and float(lb_count) == 3.0
    assert torch.equal(load, load_before + counts)
    g = torch.tensor(1.7, device=device)
    loss.backward(g)
    torch.testing.assert_close(colsum.grad.double(), 1.7 * scale * counts.double(), rtol=1e-5, atol=0)
    # without running sums: the same value, nothing else written
    assert float(balance_loss(colsum.detach(), counts, scale)) == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(ValueError, match="colsum must be fp32"):
        balance_loss(colsum.detach().double(), counts, scale)
