"""Triton LayerNorm / RMSNorm (model/norm.py) against float64 torch references: outputs and the
gradients of input, weight and bias; on CPU through Triton's interpreter (fp32, fp16) and in bf16
on a GPU. And the module: a drop-in for megatron's WrappedTorchNorm in our layer spec."""
import pytest
import torch
import torch.nn.functional as F

from megatron_dmoe.model.norm import FusedNorm, fused_norm

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(x, weight, bias, eps, rms):
    if rms:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _check(shape, dtype, rms, device, with_bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (3 * torch.randn(*shape, generator=g) + 0.5).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).to(device)
    bias = None if rms or not with_bias else (0.2 * torch.randn(n, generator=g)).to(dtype).to(device)
    dy = torch.randn(*shape, generator=g).to(dtype).to(device)
    ours = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    wide = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y = fused_norm(ours[0], ours[1], ours[2], 1e-5, rms)
    expected = _reference(wide[0], wide[1], wide[2], 1e-5, rms)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    expected.backward(dy.double())
    tol = TOLERANCE[dtype]
    bias_grad = (("db", ours[2].grad, wide[2].grad),) if bias is not None else ()
    for name, got, want in (("y", y, expected), ("dx", ours[0].grad, wide[0].grad),
                            ("dw", ours[1].grad, wide[1].grad)) + bias_grad:
        err = float((got.double() - want).norm() / want.norm())
        assert err < tol, (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(7, 3, 48), (5, 100), (1, 1, 16)], ids=["3d", "width-100", "one-row"])
def test_matches_float64_reference(shape, rms, dtype, device):
    _check(shape, dtype, rms, device)


def test_layernorm_without_bias(device):
    _check((6, 40), torch.float32, False, device, with_bias=False)


def test_argument_errors(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="RMSNorm takes no bias"):
        fused_norm(x, torch.ones(8, device=device), torch.zeros(8, device=device), 1e-5, rms=True)
    with pytest.raises(ValueError, match=r"must be \[8\]"):
        fused_norm(x, torch.ones(9, device=device), None, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_bf16_on_gpu_at_gpt_small_size(rms):
    _check((1024, 16, 768), torch.bfloat16, rms, torch.device("cuda"))


@pytest.mark.gpu
def test_module_on_gpu_matches_torch_layernorm():
    """The module's CUDA path (the kernels) against torch.nn.LayerNorm with the same parameters."""
    from types import SimpleNamespace

    config = SimpleNamespace(normalization="LayerNorm")
    ours = FusedNorm(config, 768).cuda().bfloat16()
    torch_ln = torch.nn.LayerNorm(768).cuda().bfloat16()
    with torch.no_grad():
        ours.weight.normal_(1, 0.2)
        ours.bias.normal_(0, 0.2)
    torch_ln.load_state_dict(ours.state_dict())
    x = torch.randn(512, 4, 768, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ours(x), torch_ln(x), rtol=2e-2, atol=2e-2)


def test_module_is_a_drop_in_for_megatrons_torch_norm():
    """Same parameters and state-dict keys as torch.nn.LayerNorm / RMSNorm, and on CPU tensors the
    same values (torch's functional norms)."""
    from types import SimpleNamespace

    for kind, torch_cls in (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)):
        config = SimpleNamespace(normalization=kind)
        ours, theirs = FusedNorm(config, 24, eps=1e-5), torch_cls(24, eps=1e-5)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_()
        theirs.load_state_dict(ours.state_dict())
        x = torch.randn(3, 5, 24)
        torch.testing.assert_close(ours(x), theirs(x))
    # under sequence parallelism its parameters are marked for megatron's sum over the tensor group
    sequence = FusedNorm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=True), 24)
    assert all(p.sequence_parallel for p in sequence.parameters())
    assert not any(hasattr(p, "sequence_parallel") for p in ours.parameters())
    with pytest.raises(ValueError, match="LayerNorm and RMSNorm"):
        FusedNorm(SimpleNamespace(normalization="L2Norm"), 24)


def test_local_layer_spec_uses_it():
    from megatron_dmoe.model.spec import layer_spec

    for moe in (False, True):
        spec = layer_spec(moe=moe)
        assert spec.submodules.input_layernorm is FusedNorm
        assert spec.submodules.pre_mlp_layernorm is FusedNorm
