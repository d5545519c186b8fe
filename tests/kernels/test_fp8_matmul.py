"""Block-scaled fp8 products (dmoe_kernels.fp8: the pure-torch reference and the Triton kernel)
against float64, on CPU through Triton's interpreter (its fp8 dots decode to fp16 exactly).

Bounds, with |A|, |B| the operands' magnitudes and Ea, Eb their quantization bounds
(test_fp8_quantize.py: E = 2^-4 |x| (1 + 2^-20) + 2^-10 s per element):
- against the float64 product of the same quantized operands, fp32 accumulation (each 128 of K
  summed, scaled by two factors, added to the accumulator):
      |c - ref| <= (K + 2 ceil(K/128) + 4) 2^-24 (|Aq| @ |Bq|)         (fp32 output)
  and 2^-8 |ref| more, twice the above, for a bf16 output;
- against the product of the unquantized operands: the quantization's share
      Ea @ |B| + |A| @ Eb + Ea @ Eb
  on top of the above and the bf16 product's own rounding (2^-8 |A @ B|, and its accumulation)."""
import pytest
import torch

from dmoe_kernels.fp8 import reference as ref

IMPLS = ["torch", "triton", "triton-pointers"]


def _matmul(impl):
    """The product under test; the kernels with their fp32 sums after every tensor-core
    instruction, so that the fp32 bound holds on Hopper too (its default is checked on GPUs below):
    `triton` takes the TMA kernel where the layouts allow, `triton-pointers` the pointer kernel."""
    if impl == "torch":
        return ref.matmul
    from dmoe_kernels.fp8 import ops
    return lambda *args, **kw: ops.matmul(*args, precise=True, tma=impl == "triton", **kw)


def _operands(m, k, n, b_layout, device):
    a = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(torch.bfloat16).to(device)
    b = (torch.randn(k, n) * 0.05).to(torch.bfloat16).to(device)
    a[0, :128] = 0  # an all-zero tile of a
    aq, sa = ref.quantize_rows(a)
    if b_layout == "blocks":  # a weight, 128 x 128 blocks
        bq, sb = ref.quantize_blocks(b)
    else:  # the weight gradient's right operand: b^T's rows, 1 x 128 along K
        q, s = ref.quantize_rows(b.t())
        bq, sb = q.t(), s.t()
    return a, b, aq, sa, bq, sb


def _quant_error(x, q, s_full):
    return 2.0**-4 * x.abs() * (1 + 2.0**-20) + 2.0**-10 * s_full


def _accumulation_bound(k, aq64, bq64):
    return (k + 2 * ref.tiles(k) + 4) * 2.0**-24 * (aq64.abs() @ bq64.abs())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,k,n,b_layout", [(96, 256, 160, "blocks"), (70, 300, 130, "blocks"),
                                             (64, 384, 200, "columns")],
                         ids=["blocks-aligned-k", "blocks-ragged", "columns"])
def test_fp8_matmul_against_float64(impl, m, k, n, b_layout, device, seeded_by_name):
    a, b, aq, sa, bq, sb = _operands(m, k, n, b_layout, device)
    matmul = _matmul(impl)
    aq64 = ref.dequantize_rows(aq.cpu(), sa.cpu(), torch.float64)
    sb_cols = ref.column_scales(sb.cpu(), n).double()
    bq64 = bq.cpu().double() * sb_cols.repeat_interleave(128, 0)[:k]
    exact = aq64 @ bq64
    acc_bound = _accumulation_bound(k, aq64, bq64)

    c32 = matmul(aq, sa, bq, sb, out_dtype=torch.float32).double().cpu()
    assert ((c32 - exact).abs() <= acc_bound).all(), float(((c32 - exact).abs() / acc_bound).max())
    c = matmul(aq, sa, bq, sb)
    assert c.dtype == torch.bfloat16 and c.shape == (m, n)
    c = c.double().cpu()
    assert ((c - exact).abs() <= 2.0**-8 * exact.abs() + 2 * acc_bound).all()

    # against the product of the unquantized operands (computed in float64, and as bf16 does)
    a64, b64 = a.double().cpu(), b.double().cpu()
    ea = _quant_error(a64, None, sa.cpu().double().repeat_interleave(128, 1)[:, :k])
    eb = _quant_error(b64, None, sb_cols.repeat_interleave(128, 0)[:k])
    quant = ea @ b64.abs() + a64.abs() @ eb + ea @ eb
    plain = a64 @ b64
    assert ((c - plain).abs() <= quant + 2.0**-8 * (exact.abs() + plain.abs()) + 2 * acc_bound).all()
    bf16 = (a.float() @ b.float()).to(torch.bfloat16).double().cpu()  # bf16 operands, fp32 sums, bf16 out
    bf16_bound = 2.0**-8 * plain.abs() + _accumulation_bound(k, a64, b64)
    assert ((c - bf16).abs() <= quant + 2.0**-8 * exact.abs() + 2 * acc_bound + bf16_bound).all()
    # what the bound allows is the worst case; typically fp8 is off by a few percent of bf16
    rel = float((c - bf16).norm() / bf16.norm())
    print(f"relative Frobenius difference fp8 vs bf16: {rel:.4f}")
    assert rel < 0.08


@pytest.mark.parametrize("m,k,n,b_layout,k_major,tma", [
    (96, 256, 160, "blocks", False, True), (64, 384, 200, "columns", True, True), (96, 256, 160, "blocks", True, True),
    (70, 300, 130, "blocks", False, False), (64, 384, 200, "columns", False, False)],
    ids=["row-major-b", "k-major-b-columns", "k-major-b-blocks", "a-rows-not-16-byte-aligned",
         "b-rows-not-16-byte-aligned"])
def test_fp8_matmul_takes_the_tma_kernel_where_the_layouts_allow(m, k, n, b_layout, k_major, tma, device,
                                                                  monkeypatch):
    from dmoe_kernels.fp8 import ops

    taken = []
    tma_kernel = ops._matmul_tma
    monkeypatch.setattr(ops, "_matmul_tma", lambda *args: taken.append(args[4].shape) or tma_kernel(*args))
    _, _, aq, sa, bq, sb = _operands(m, k, n, b_layout, device)
    if k_major:  # b as the transpose of a row-major [N, K] matrix (a weight, or x^T in the weight gradient)
        bq = bq.t().contiguous().t()
    c = ops.matmul(aq, sa, bq, sb, precise=True)
    assert taken == ([(m, n)] if tma else [])
    pointers = ops.matmul(aq, sa, bq, sb, precise=True, tma=False)
    assert torch.equal(c, pointers)  # both sum each 128 of K in fp32 and promote it alike


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_matmul_refuses_mismatched_scales(impl, device):
    matmul = _matmul(impl)
    aq, sa = ref.quantize_rows(torch.randn(8, 256, device=device))
    bq, sb = ref.quantize_blocks(torch.randn(256, 64, device=device))
    with pytest.raises(ValueError, match=r"a's scales must be \[M, ceil\(K/128\)\] = \[8, 2\]"):
        matmul(aq, sa[:, :1], bq, sb)
    with pytest.raises(ValueError, match="b's scales must be"):
        matmul(aq, sa, bq, sb[:, :0])
    with pytest.raises(ValueError, match="operands must be float8_e4m3fn"):
        matmul(aq.float(), sa, bq, sb)


def test_fp8_matmul_refuses_gpus_without_fp8_tensor_cores(monkeypatch):
    from dmoe_kernels.fp8 import ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 8.0\) has no fp8 tensor cores \(8.9 or newer\)"):
        ops.check_fp8_dots(torch.device("cuda"))
    ops.check_fp8_dots(torch.device("cpu"))  # the interpreter: no tensor cores asked for


@pytest.mark.gpu
def test_fp8_matmul_default_accumulation_on_gpu(seeded_by_name):
    """The kernel's default (Hopper's reduced-precision fp8 accumulation within each 128 of K,
    promoted to fp32 after it: DeepSeek-V3's scheme) against its fp32-throughout mode. Assumed, from
    DeepSeek-V3's report (about 14 bits kept by the tensor cores): within 2^-7 of sum |a||b| per
    element, and a relative difference of the whole product under 2e-3."""
    from dmoe_kernels.fp8 import ops

    m, k, n = 1024, 4096, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    aq, sa = ops.quantize_rows(a)
    wq, sw = ops.quantize_blocks(w)
    chunked = ops.matmul(aq, sa, wq.t(), sw.t(), out_dtype=torch.float32).double()
    precise = ops.matmul(aq, sa, wq.t(), sw.t(), out_dtype=torch.float32, precise=True).double()
    aq64, wq64 = ref.dequantize_rows(aq, sa, torch.float64), ref.dequantize_blocks(wq, sw, torch.float64)
    magnitude = aq64.abs() @ wq64.abs().t()
    assert ((chunked - precise).abs() <= 2.0**-7 * magnitude).all()
    assert float((chunked - precise).norm() / precise.norm()) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [64, 128])
def test_fp8_matmul_kernel_matches_reference_at_training_shapes(block_m, seeded_by_name):
    """On a GPU: the kernel (the compiled one, with Hopper's fp8 tensor cores) against the torch
    reference at a training-sized product, both fp32-accumulated from the same fp8 operands."""
    from dmoe_kernels.fp8 import ops

    m, k, n = 4096, 2048, 1536
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    aq, sa = ops.quantize_rows(a)
    wq, sw = ops.quantize_blocks(w)
    c = ops.matmul(aq, sa, wq.t(), sw.t(), out_dtype=torch.float32, block_m=block_m, precise=True)
    expected = ref.matmul(aq, sa, wq.t(), sw.t(), out_dtype=torch.float32)
    aq64 = ref.dequantize_rows(aq, sa, torch.float64)
    wq64 = ref.dequantize_blocks(wq, sw, torch.float64)
    bound = 2 * _accumulation_bound(k, aq64, wq64.t())
    assert ((c.double() - expected.double()).abs() <= bound).all()
