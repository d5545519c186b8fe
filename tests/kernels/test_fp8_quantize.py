"""Block-scaled fp8 quantization (dmoe_kernels.fp8) against a float64 reference written apart
(fp8_reference64.py), for the pure-torch version and the Triton kernels (interpreter on CPU).

The bound checked on every element: e4m3 keeps 3 mantissa bits, so rounding x / s to nearest is off
by at most 2^-4 of |x / s| (half a spacing) in the normal range, and by at most 2^-10 (half the
subnormals' 2^-9 spacing) below 2^-6; times the tile's scale s, plus fp32's rounding of x / s:
    |dequantize(q) - x| <= 2^-4 * |x| * (1 + 2^-20) + 2^-10 * s.
Beyond the bound, q must be exactly the float64 reference's nearest-even rounding wherever x / s is
not within fp32 rounding of a midpoint, and the scales exactly amax / 448 rounded to fp32."""
import pytest
import torch

from fp8_reference64 import near_midpoint, quantize_blocks64, quantize_rows64

IMPLS = ["torch", "triton"]


def _fp8(impl):
    if impl == "torch":
        from dmoe_kernels.fp8 import reference as fp8
    else:
        from dmoe_kernels.fp8 import ops as fp8
    return fp8


def _rows_input(shape, dtype, device):
    x = torch.randn(shape, dtype=torch.float64)
    x = x * torch.logspace(-3, 3, shape[-1], dtype=torch.float64)  # widely different magnitudes
    flat = x.view(-1, shape[-1])
    flat[0, :128] = 0  # an all-zero tile
    if shape[-1] > 128:
        flat[0, 128] = 1e-30  # a tile of one tiny value and zeros
        flat[-1, -1] = -5e4  # a tile whose small entries fall to e4m3's subnormals
    return x.to(dtype).to(device)


def _check(q, s, x, q64, s64, v64):
    x64 = x.double().cpu()
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and torch.equal(s.double().cpu(), s64)
    assert (s > 0).all() and torch.isfinite(s).all()
    qd = q.double().cpu()
    exact = ~near_midpoint(v64)
    assert torch.equal(qd[exact], q64[exact]), f"{int((qd != q64)[exact].sum())} elements differ"
    assert ((qd - v64).abs() <= 2.0**-4 * v64.abs() * (1 + 2.0**-20) + 2.0**-10).all()
    return x64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,dtype", [((4, 256), torch.bfloat16), ((5, 300), torch.float32),
                                         ((2, 3, 130), torch.float16)], ids=["bf16-256", "fp32-300", "fp16-3d-130"])
def test_quantize_rows_against_float64(impl, shape, dtype, device, seeded_by_name):
    fp8 = _fp8(impl)
    x = _rows_input(shape, dtype, device)
    q, s = fp8.quantize_rows(x)
    q64, s64, v64 = quantize_rows64(x.cpu())
    x64 = _check(q, s, x, q64, s64, v64)
    assert s.shape == (*shape[:-1], -(-shape[-1] // 128))
    if impl == "triton":  # M-major: a product's K step reads its rows' scales from consecutive addresses
        assert s.reshape(-1, s.shape[-1]).stride(0) == 1
    assert (q.view(-1, shape[-1])[0, :128].double() == 0).all()  # the zero tile stays zero, no NaN

    from dmoe_kernels.fp8.reference import dequantize_rows
    d = dequantize_rows(q.cpu(), s.cpu(), torch.float64)
    bound = 2.0**-4 * x64.abs() * (1 + 2.0**-20) + 2.0**-10 * s64.repeat_interleave(128, -1)[..., :shape[-1]]
    assert ((d - x64).abs() <= bound).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,dtype", [((256, 384), torch.bfloat16), ((200, 130), torch.float32)],
                         ids=["bf16-256x384", "fp32-200x130"])
def test_quantize_blocks_against_float64(impl, shape, dtype, device, seeded_by_name):
    fp8 = _fp8(impl)
    w = (torch.randn(shape, dtype=torch.float64) * torch.logspace(-2, 2, shape[1], dtype=torch.float64))
    w[:128, :128] = 0  # an all-zero block
    w[-1, -1] = 1e3  # one large entry: the block's others lean on the subnormals
    w = w.to(dtype).to(device)
    q, s = fp8.quantize_blocks(w)
    q64, s64, v64 = quantize_blocks64(w.cpu())
    x64 = _check(q, s, w, q64, s64, v64)
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))

    from dmoe_kernels.fp8.reference import dequantize_blocks
    d = dequantize_blocks(q.cpu(), s.cpu(), torch.float64)
    s_full = s64.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    assert ((d - x64).abs() <= 2.0**-4 * x64.abs() * (1 + 2.0**-20) + 2.0**-10 * s_full).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_refuses_non_float_input(impl, device):
    fp8 = _fp8(impl)
    with pytest.raises(ValueError, match="quantize_rows: expects a float32/bfloat16/float16"):
        fp8.quantize_rows(torch.ones(2, 128, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="quantize_blocks: expects a 2-d tensor"):
        fp8.quantize_blocks(torch.ones(2, 2, 128, device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_rows_of_a_transpose(impl, device, seeded_by_name):
    """The weight gradient quantizes activations along the tokens: the rows of x^T, read in place."""
    fp8 = _fp8(impl)
    x = torch.randn(140, 136, device=device).to(torch.bfloat16)
    q, s = fp8.quantize_rows(x.t())
    q_c, s_c = fp8.quantize_rows(x.t().contiguous())
    assert torch.equal(q.view(torch.uint8), q_c.view(torch.uint8)) and torch.equal(s, s_c)
