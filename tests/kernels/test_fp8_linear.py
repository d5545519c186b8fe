"""dmoe_kernels.fp8.functional.linear: its output and both gradients against the float64 linear of
the same (unquantized) tensors, within each product's bound (test_fp8_matmul.py's docstring):
    Ea @ |B| + |A| @ Eb + Ea @ Eb  +  the output's rounding  +  fp32 accumulation,
with Ea, Eb the operands' quantization bounds (2^-4 |x| (1 + 2^-20) + 2^-10 s, s their tiles'
scales from the float64 reference, fp8_reference64.py) under the tiling each product uses.
That bound is a worst case, loose for a systematic error of a few percent; so each product is also
checked tightly against the float64 product of its quantized operands (quantized by the pure-torch
quantizers, which test_fp8_quantize.py holds to float64): a wrong scale, tile or operand shows."""
import pytest
import torch
import torch.nn.functional as F

from dmoe_kernels.fp8 import reference as ref
from dmoe_kernels.fp8.functional import linear
from fp8_reference64 import quantize_blocks64, quantize_rows64

ROUNDING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


def _row_error(x64):
    """Quantization bound of x's 1 x 128 tiles along its last dimension."""
    s = quantize_rows64(x64)[1].repeat_interleave(128, -1)[..., :x64.shape[-1]]
    return 2.0**-4 * x64.abs() * (1 + 2.0**-20) + 2.0**-10 * s


def _block_error(w64):
    s = quantize_blocks64(w64)[1]
    s = s.repeat_interleave(128, 0)[:w64.shape[0]].repeat_interleave(128, 1)[:, :w64.shape[1]]
    return 2.0**-4 * w64.abs() * (1 + 2.0**-20) + 2.0**-10 * s


def _product_bound(a, ea, b, eb, out_dtype):
    k = a.shape[1]
    quant = ea @ b.abs() + a.abs() @ eb + ea @ eb
    acc = (k + 2 * -(-k // 128) + 4) * 2.0**-24 * ((a.abs() + ea) @ (b.abs() + eb))
    return quant + ROUNDING[out_dtype] * (a @ b).abs() * 2 + 2 * acc


def _rows64(t):
    return ref.dequantize_rows(*ref.quantize_rows(t), torch.float64)


def _blocks64(w):
    return ref.dequantize_blocks(*ref.quantize_blocks(w), torch.float64)


def _quantized_product(got, aq, bq, out_dtype, what):
    """got against the float64 product of the quantized operands: output rounding, fp32 sums."""
    exact = aq @ bq
    acc = (aq.shape[1] + 2 * -(-aq.shape[1] // 128) + 4) * 2.0**-24 * (aq.abs() @ bq.abs())
    _within(got, exact, ROUNDING[out_dtype] * exact.abs() + 2 * acc, what + " (quantized operands)")


def _within(got, expected, bound, what):
    over = (got.double() - expected).abs() - bound
    assert (over <= 0).all(), f"{what}: {int((over > 0).sum())} elements past the bound"


@pytest.mark.parametrize("impl,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                        ("triton", torch.bfloat16)])
def test_fp8_linear_output_and_gradients(impl, dtype, device, seeded_by_name):
    # 100 tokens (a ragged tile along the tokens for the weight gradient), N = 192 (ragged blocks)
    x = torch.randn(4, 25, 256, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(192, 256, device=device) * 0.05).to(dtype).requires_grad_()
    bias = torch.randn(192, device=device).to(dtype).requires_grad_()
    w_before = weight.detach().clone()
    dy = torch.randn(4, 25, 192, device=device).to(dtype)

    y = linear(x, weight, bias, impl=impl)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and weight.grad.dtype == dtype
    assert torch.equal(weight.detach(), w_before)  # the master weight is only read

    x64, w64, dy64 = (t.detach().double().cpu().reshape(-1, t.shape[-1]) for t in (x, weight, dy))
    ex, ew = _row_error(x64), _block_error(w64)
    y_bound = _product_bound(x64, ex, w64.t(), ew.t(), dtype) + ROUNDING[dtype] * bias.detach().double().abs().cpu()
    _within(y.detach().cpu().reshape(-1, 192), x64 @ w64.t() + bias.detach().double().cpu(), y_bound, "y")
    _within(x.grad.cpu().reshape(-1, 256), dy64 @ w64, _product_bound(dy64, _row_error(dy64), w64, ew, dtype), "dx")
    dw_bound = _product_bound(dy64.t(), _row_error(dy64.t()), x64, _row_error(x64.t()).t(), dtype)
    _within(weight.grad.cpu(), dy64.t() @ x64, dw_bound, "dW")
    assert torch.equal(bias.grad.cpu(), dy.sum((0, 1)).cpu())  # the bias is added outside fp8

    if impl == "triton" and device.type == "cuda":
        return  # Hopper's fp8 accumulation within 128 of K: the GPU test below compares with torch's
    x2, w2, dy2 = (t.detach().cpu().reshape(-1, t.shape[-1]) for t in (x, weight, dy))
    with torch.no_grad():
        y_plain = linear(x, weight, impl=impl).cpu().reshape(-1, 192)
    _quantized_product(y_plain, _rows64(x2), _blocks64(w2).t(), dtype, "y")
    _quantized_product(x.grad.cpu().reshape(-1, 256), _rows64(dy2), _blocks64(w2), dtype, "dx")
    _quantized_product(weight.grad.cpu(), _rows64(dy2.t()), _rows64(x2.t()).t(), dtype, "dW")

    # typically a few percent off the linear in the inputs' own dtype
    xs, ws = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.linear(xs, ws).backward(dy)
    for got, plain in ((x.grad, xs.grad), (weight.grad, ws.grad)):
        assert float((got.float() - plain.float()).norm() / plain.float().norm()) < 0.08


def test_fp8_linear_weight_gradient_in_the_inputs_dtype(device, seeded_by_name):
    """fp8_wgrad=False (the model's fp8 linears): the same output and input gradient, and the weight
    gradient dy^T x in x's dtype, as torch.nn.functional.linear gives it."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(3, 40, 256, device=device).to(dtype)
    weight = (torch.randn(192, 256, device=device) * 0.05).to(dtype)
    dy = torch.randn(3, 40, 192, device=device).to(dtype)
    grads = []
    for fp8_wgrad in (True, False):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = linear(xi, wi, fp8_wgrad=fp8_wgrad)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, wi.grad))
    (y8, dx8, _), (y, dx, dw) = grads
    assert torch.equal(y, y8) and torch.equal(dx, dx8)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    F.linear(xs, ws).backward(dy)
    torch.testing.assert_close(dw, ws.grad, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_fp8_linear_refuses_bad_arguments(device):
    x = torch.randn(3, 128, device=device)
    with pytest.raises(ValueError, match=r"expects x \[..., K\] and weight \[N, K\]"):
        linear(x, torch.randn(4, 64, device=device))
    with pytest.raises(ValueError, match="impl must be one of auto, torch, triton, cublas, got 'cuda'"):
        linear(x, torch.randn(4, 128, device=device), impl="cuda")


@pytest.mark.gpu
def test_fp8_linear_kernels_match_the_reference_on_gpu(seeded_by_name):
    """The Triton path against the pure-torch one on a GPU at a training shape: the same fp8
    operands, so only the accumulation differs (Hopper's within each 128 of K, then fp32, against
    fp32 throughout) and the bf16 outputs' rounding: 5.1e-3 apart on an H200 (one or two bf16
    steps of an element). A scale 1 % off moves them 1e-2 apart. Both a few percent off bf16's
    linear."""
    x = torch.randn(8, 512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(4096, 2048, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(8, 512, 4096, device="cuda", dtype=torch.bfloat16)
    results = {}
    for impl in ("triton", "torch", "cublas"):
        xi, wi = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        linear(xi, wi, impl=impl).backward(dy)
        results[impl] = (xi.grad.float(), wi.grad.float())
    for impl in ("triton", "cublas"):  # cuBLAS: the forward and the input gradient (K/128 = 16, 32)
        for got, expected in zip(results[impl], results["torch"]):
            assert float((got - expected).norm() / expected.norm()) < 8e-3, impl
    F.linear(x, weight).backward(dy)
    for got, plain in zip(results["triton"], (x.grad.float(), weight.grad.float())):
        assert float((got - plain).norm() / plain.norm()) < 0.08


@pytest.mark.gpu
def test_cublas_products_where_cublas_takes_them(seeded_by_name):
    """fp8/cublas.py against the pure-torch product of the same fp8 operands, and refused where
    cuBLAS misreads the scales (K / 128 not a multiple of 4)."""
    from dmoe_kernels.fp8 import cublas, ops

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(384, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    xq, xs = ops.quantize_rows(x)
    wq, ws = ops.quantize_blocks(w)
    assert cublas.supported(xq, wq.t())
    got = cublas.matmul(xq, xs, wq.t(), ws.t(), torch.float32)
    want = ref.matmul(xq, xs, wq.t(), ws.t(), torch.float32)
    assert float((got - want).abs().max() / want.abs().max()) < 2e-3
    narrow_q, _ = ops.quantize_rows(torch.randn(256, 768, device="cuda"))
    assert not cublas.supported(narrow_q, ops.quantize_blocks(torch.randn(384, 768, device="cuda"))[0].t())


def test_cublas_impl_falls_back_off_cuda(device, seeded_by_name):
    """impl='cublas' where cuBLAS cannot take the products (CPU, the interpreter; on CUDA 4 rows,
    not a multiple of 16, and K / 128 = 1) gives the Triton kernels' results."""
    x = torch.randn(4, 128, device=device)
    w = torch.randn(32, 128, device=device) * 0.05
    assert torch.equal(linear(x, w, impl="cublas"), linear(x, w, impl="triton"))
