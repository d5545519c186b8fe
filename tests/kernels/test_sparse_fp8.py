"""The block-sparse products of block-scaled fp8 operands (products/fp8_ops.py) against float64 on
the same quantized operands, on dMoE topologies with blocks past nnz and an empty expert; on CPU
through Triton's interpreter (its fp8 dots decode to fp16 exactly, and it sums in fp32)."""
import pytest
import torch

import dmoe_kernels as dk
import dmoe_kernels.reference as ref
from dmoe_kernels.fp8 import reference as fp8_ref
from dmoe_kernels.products import fp8_ops

# fp32 outputs, fp32 sums after every product: float64 on the same fp8 values within fp32 rounding
TOL = 1e-5


def _topology(device, counts=(20, 0, 3, 26), f=64, bs=16):
    topo = dk.Topology.for_experts(torch.tensor(counts, device=device), sum(counts), f, bs)
    assert int(topo.nnz) < topo.max_blocks
    return topo


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("K", [256, 208], ids=["whole-tiles", "ragged-k"])
def test_sdd_fp8_against_float64(K, device, seeded_by_name):
    topo = _topology(device)
    rows, cols = topo.shape
    x = (torch.randn(rows, K) * torch.logspace(-1, 1, K)).to(device)
    w = (torch.randn(cols, K) * 0.05).to(device)
    xq, xs = fp8_ref.quantize_rows(x)
    wq, ws = fp8_ref.quantize_blocks(w)
    out = fp8_ops.sdd_fp8(xq, xs, wq, ws, topo, out_dtype=torch.float32, precise=True)
    x64 = fp8_ref.dequantize_rows(xq.cpu(), xs.cpu(), torch.float64)
    w64 = fp8_ref.dequantize_blocks(wq.cpu(), ws.cpu(), torch.float64)
    mask = ref.block_mask_dense(topo).cpu()
    expected = (x64 @ w64.t()) * mask
    nnz = int(topo.nnz)
    assert torch.isfinite(out[:nnz]).all()
    assert _rel(ref.to_dense(out, topo).cpu() * mask, expected) < TOL
    # the row scales M-major (as ops.quantize_rows stores them): the same values, bit for bit
    m_major = fp8_ops.sdd_fp8(xq, xs.t().contiguous().t(), wq, ws, topo, out_dtype=torch.float32, precise=True)
    assert torch.equal(m_major[:nnz], out[:nnz])
    bf16 = fp8_ops.sdd_fp8(xq, xs, wq, ws, topo)
    assert bf16.dtype == torch.bfloat16
    assert _rel(ref.to_dense(bf16, topo).cpu() * mask, expected) < 2**-8


def test_dsd_fp8_against_float64(device, seeded_by_name):
    topo = _topology(device, counts=(40, 0, 7, 70), f=128, bs=32)  # fp8 tensor cores: K steps >= 32
    rows, cols = topo.shape
    N = 48
    data = torch.randn(topo.data_shape(), device=device) * torch.logspace(-1, 1, topo.block_size, device=device)
    q, qs = fp8_ops.quantize_blocks_rows(data)
    expected_q, expected_s = fp8_ref.quantize_rows(data.reshape(-1, topo.block_size))
    assert torch.equal(q.view(-1, topo.block_size).view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(qs, expected_s.reshape(-1))
    b = (torch.randn(cols, N) * 0.05).to(device)
    bq, bs_ = fp8_ref.quantize_blocks(b)
    out = fp8_ops.dsd_fp8(q, qs, topo, bq, bs_, out_dtype=torch.float32, precise=True)
    s64 = (q.cpu().double() * qs.cpu().double().view(q.shape[0], q.shape[1], 1))
    b64 = fp8_ref.dequantize_blocks(bq.cpu(), bs_.cpu(), torch.float64)
    expected = ref.to_dense(s64, _topology("cpu", counts=(40, 0, 7, 70), f=128, bs=32)) @ b64
    assert out.shape == (rows, N)
    used = int(topo.nnz) // topo.blocks_per_row * topo.block_size  # rows of the used block rows
    assert (out[used:] == 0).all()
    assert _rel(out, expected) < TOL


def test_fp8_sparse_products_refuse_what_they_cannot_take(device):
    topo = _topology(device)
    rows, cols = topo.shape
    xq, xs = fp8_ref.quantize_rows(torch.randn(rows, 128, device=device))
    wq, ws = fp8_ref.quantize_blocks(torch.randn(cols, 128, device=device))
    with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
        fp8_ops.sdd_fp8(xq.float(), xs, wq, ws, topo)
    with pytest.raises(ValueError, match="scales must be"):
        fp8_ops.sdd_fp8(xq, xs[:, :0], wq, ws, topo)
    mask = torch.zeros(rows // 16, cols // 16, dtype=torch.bool)
    mask[0, :3] = mask[1, 5] = True  # rows of different lengths: not the dMoE layout
    irregular = dk.Topology.from_mask(mask.to(device), 16)
    assert not irregular.blocks_per_row
    with pytest.raises(ValueError, match="needs a dMoE topology"):
        fp8_ops.sdd_fp8(xq, xs, wq, ws, irregular)


# tile configs: neighbouring blocks (sdd) or columns (dsd) per tile, tiles per block row (rows of
# bs / split), and the schedule; at bs 32 a split of 2 gives 16-row tiles
CONFIGS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("width,split", CONFIGS, ids=[f"w{w}-split{s}" for w, s in CONFIGS])
def test_sdd_fp8_tile_configs_agree(width, split, device, seeded_by_name):
    topo = _topology(device, counts=(40, 0, 7, 70), f=128, bs=32)
    rows, cols = topo.shape
    xq, xs = fp8_ref.quantize_rows(torch.randn(rows, 160, device=device))
    wq, ws = fp8_ref.quantize_blocks(torch.randn(cols, 160, device=device) * 0.05)
    cfg = fp8_ops.Fp8Config(width, split, 2, 4, 1)
    out = fp8_ops.sdd_fp8(xq, xs, wq, ws, topo, out_dtype=torch.float32, precise=True, config=cfg)
    x64 = fp8_ref.dequantize_rows(xq.cpu(), xs.cpu(), torch.float64)
    w64 = fp8_ref.dequantize_blocks(wq.cpu(), ws.cpu(), torch.float64)
    mask = ref.block_mask_dense(topo).cpu()
    assert _rel(ref.to_dense(out, topo).cpu() * mask, (x64 @ w64.t()) * mask) < TOL


@pytest.mark.parametrize("k_major", [False, True], ids=["b-row-major", "b-k-major"])
@pytest.mark.parametrize("width,split", [(128, 1), (16, 2)], ids=["n128", "n16-split2"])
def test_dsd_fp8_tile_configs_and_layouts_agree(width, split, k_major, device, seeded_by_name):
    topo = _topology(device, counts=(40, 0, 7, 70), f=128, bs=32)
    rows, cols = topo.shape
    N = 176  # two tiles of 128 columns, the second ragged
    data = torch.randn(topo.data_shape(), device=device)
    q, qs = fp8_ops.quantize_blocks_rows(data)
    b = torch.randn(cols, N, device=device) * 0.05
    if k_major:  # the weight's transpose quantized row-major: the same blocks and scales, transposed
        bt_q, bt_s = fp8_ref.quantize_blocks(b.t().contiguous())
        bq, bs_ = bt_q.t(), bt_s.t()
    else:
        bq, bs_ = fp8_ref.quantize_blocks(b)
    cfg = fp8_ops.Fp8Config(width, split, 2, 4, 1)
    out = fp8_ops.dsd_fp8(q, qs, topo, bq, bs_, out_dtype=torch.float32, precise=True, config=cfg)
    s64 = (q.cpu().double() * qs.cpu().double().view(q.shape[0], q.shape[1], 1))
    b64 = fp8_ref.dequantize_blocks(bq.cpu(), bs_.cpu(), torch.float64)
    expected = ref.to_dense(s64, _topology("cpu", counts=(40, 0, 7, 70), f=128, bs=32)) @ b64
    assert _rel(out, expected) < TOL


def test_fp8_config_parse(device):
    assert fp8_ops.Fp8Config.parse("1:2:3:4:2") == fp8_ops.Fp8Config(1, 2, 3, 4, 2)
    with pytest.raises(ValueError, match="WIDTH:SPLIT:STAGES:WARPS:PER_SM"):
        fp8_ops.Fp8Config.parse("1:2:3")
    topo = _topology(device, counts=(32,), f=32, bs=32)
    rows, cols = topo.shape
    with pytest.raises(ValueError, match="power of two"):
        fp8_ops.sdd_fp8(*fp8_ref.quantize_rows(torch.randn(rows, 128, device=device)),
                        *fp8_ref.quantize_blocks(torch.randn(cols, 128, device=device)),
                        topo, config=fp8_ops.Fp8Config(1, 3, 2, 4, 1))
