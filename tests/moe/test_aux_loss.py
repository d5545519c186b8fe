"""Aux-loss values by hand, their gradients, and the scaler that feeds them to the router."""
import math

import pytest
import torch

from megatron_dmoe.moe import AuxLossScaler, load_balancing_loss, z_loss


def test_load_balancing_loss_softmax_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]], dtype=torch.float64)
    counts = torch.tensor([1, 1, 0])  # token 0 -> expert 0, token 1 -> expert 1 (top-1)
    # f = [1/2, 1/2, 0], P = [0.4, 0.4, 0.2]: 0.1 * 3 * (0.5*0.4 + 0.5*0.4) = 0.12
    assert load_balancing_loss(probs, counts, 1, 0.1).item() == pytest.approx(0.12, rel=1e-12)
    # top-2 with counts [2, 1, 1]: f = [0.5, 0.25, 0.25]; 0.1*3*(0.2 + 0.1 + 0.05) = 0.105
    assert load_balancing_loss(probs, torch.tensor([2, 1, 1]), 2, 0.1).item() == pytest.approx(0.105, rel=1e-12)


def test_load_balancing_loss_sigmoid_normalises_scores():
    scores = torch.tensor([[0.2, 0.6], [0.3, 0.1]], dtype=torch.float64)
    # per-token normalised: [[0.25, 0.75], [0.75, 0.25]] -> P = [0.5, 0.5]; f = [1/2, 1/2]
    value = load_balancing_loss(scores, torch.tensor([1, 1]), 1, 1.0, score_function="sigmoid")
    assert value.item() == pytest.approx(2 * (0.5 * 0.5 + 0.5 * 0.5), rel=1e-12)


def test_load_balancing_loss_leaves_out_padding():
    probs = torch.tensor([[0.7, 0.3], [0.1, 0.9], [0.5, 0.5]], dtype=torch.float64)
    valid = torch.tensor([True, False, True])
    counts = torch.tensor([2, 0])  # valid tokens 0 and 2 both chose expert 0
    # T = 2: f = [1, 0], P = [0.6, 0.4] -> 1 * 2 * 0.6
    assert load_balancing_loss(probs, counts, 1, 1.0, valid=valid).item() == pytest.approx(1.2, rel=1e-12)


def test_load_balancing_gradient_is_coeff_E_f_over_T():
    probs = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    load_balancing_loss(probs, counts, 2, 0.3).backward()
    expected = 0.3 * 4 * (counts.double() / (5 * 2)) / 5
    assert torch.allclose(probs.grad, expected.expand(5, 4), rtol=1e-12, atol=0)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)
    # logsumexp: log 4 and log 2
    expected = 0.01 * (math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2
    assert z_loss(logits, 0.01).item() == pytest.approx(expected, rel=1e-12)
    valid = torch.tensor([False, True])
    assert z_loss(logits, 0.01, valid).item() == pytest.approx(0.01 * math.log(2.0) ** 2, rel=1e-12)


def test_aux_loss_scaler_is_identity_and_injects_scaled_gradient():
    w = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
    out = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    aux = (w**2).sum()  # d aux / d w = 2w
    try:
        for scale in (1.0, 0.25, torch.tensor(0.125)):
            AuxLossScaler.set_loss_scale(scale)
            w.grad = out.grad = None
            y = AuxLossScaler.apply(out, (w**2).sum())
            assert torch.equal(y, out)
            y.add_(1.0)  # callers may modify the output in place
            g = torch.randn(3, 4, dtype=torch.float64)
            y.backward(g)
            assert torch.equal(out.grad, g)
            assert torch.allclose(w.grad, 2 * w.detach() * float(scale), rtol=1e-12, atol=0)
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    assert aux.requires_grad


def test_aux_loss_scale_set_from_a_float_reaches_an_aux_loss_on_another_device():
    """A scale set from a Python float lives on the CPU; an aux loss elsewhere (CUDA in training, the
    meta device here) still gets it as its gradient, where megatron-core's own backward raised."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        AuxLossScaler.set_loss_scale(0.5)
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.device.type == "cpu"
        y = torch.randn(3, device="meta", requires_grad=True)
        aux = torch.randn((), device="meta", requires_grad=True)
        AuxLossScaler.apply(y, aux).sum().backward()
        assert aux.grad is not None and aux.grad.shape == () and aux.grad.device.type == "meta"
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
