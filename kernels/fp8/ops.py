"""Launchers of the fp8 kernels (kernels.py): the signatures and results of reference.py's
quantize_rows, quantize_blocks and matmul, on CUDA tensors or through Triton's interpreter."""
from __future__ import annotations

import torch
import triton

from ..launch import check_launchable, direct, tma_descriptor, tma_ready, triton_dtype
from . import kernels as k
from .reference import FP8, TILE, check_float, check_matmul, tiles

QUANT_ROWS = 32  # rows per program of quantize_rows
FP8_DOTS = (8, 9)  # the compute capability of the first fp8 tensor cores (Ada)


def quantize_rows(x: torch.Tensor):
    """x [..., K] -> (q [..., K] float8_e4m3fn, scales [..., ceil(K/128)] fp32). A 2-d x may be a
    transpose (any strides): its rows are quantized where they lie. The scales are stored M-major
    (the transpose of a row-major [ceil(K/128), M]): a product's K step then reads its rows' scales
    from consecutive addresses, as cuBLAS's block-scaled products also want them."""
    check_float(x, "quantize_rows", 0)
    check_launchable(k.quantize_rows_kernel, x.device)
    shape = x.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
    m, kk = x2.shape
    q = torch.empty(m, kk, dtype=FP8, device=x.device)
    s = torch.empty(tiles(kk), m, dtype=torch.float32, device=x.device).t()
    if m:
        direct(k.quantize_rows_kernel)[(triton.cdiv(m, QUANT_ROWS), tiles(kk))](
            x2, q, s, m, kk, x2.stride(0), x2.stride(1), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_M=QUANT_ROWS, TILE=TILE)
    return q.reshape(shape), s.reshape(*shape[:-1], -1)


def quantize_blocks(w: torch.Tensor):
    """w [R, C] (any strides) -> (q [R, C] float8_e4m3fn, scales [ceil(R/128), ceil(C/128)] fp32)."""
    check_float(w, "quantize_blocks", 2)
    check_launchable(k.quantize_blocks_kernel, w.device)
    r, c = w.shape
    q = torch.empty(r, c, dtype=FP8, device=w.device)
    s = torch.empty(tiles(r), tiles(c), dtype=torch.float32, device=w.device)
    if r:
        direct(k.quantize_blocks_kernel)[(tiles(r), tiles(c))](
            w, q, s, r, c, w.stride(0), w.stride(1), q.stride(0), s.stride(0), TILE=TILE, num_warps=8)
    return q, s


def check_fp8_dots(device: torch.device) -> None:
    """Triton's fp8 dots need fp8 tensor cores: compute capability 8.9 (Ada) or newer."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_DOTS:
        raise RuntimeError(f"fp8 matmul: this GPU (compute capability {major}.{minor}) has no fp8 tensor cores "
                           f"(8.9 or newer); use dmoe_kernels.fp8.reference.matmul")


# The TMA kernel's tiles: 64 x 128 of c, K steps of one scale tile, 3 stages of 24 KB (a's and b's
# fp8 tiles), 4 warps: small enough for two or three programs per multiprocessor, so that one's
# tensor-core work overlaps another's promotion (tools/bench_fp8.py --tma-configs)
TMA_BLOCK_M, TMA_BLOCK_N, TMA_STAGES, TMA_WARPS, TMA_GROUP_M = 64, 128, 3, 4, 8


def _tma_path(a, b, c) -> bool:
    """The operands and output as TMA reads them: a row-major, b row-major or the transpose of one,
    c row-major; on Hopper or newer, or the interpreter."""
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    return tma_ready(a) and (tma_ready(b) or tma_ready(b, transposed=True)) and tma_ready(c)


def _matmul_tma(a, a_scale, b, b_scale, c, group_n: int, precise: bool, config) -> None:
    (m, kk), n = a.shape, b.shape[1]
    bm, bn, stages, warps = config or (TMA_BLOCK_M, TMA_BLOCK_N, TMA_STAGES, TMA_WARPS)
    b_kmajor = tma_ready(b, transposed=True)
    b_desc = (tma_descriptor(b.t(), [bn, TILE]) if b_kmajor else tma_descriptor(b, [TILE, bn]))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    direct(k.matmul_tma_kernel)[grid](
        tma_descriptor(a, [bm, TILE]), b_desc, tma_descriptor(c, [bm, bn]),
        a_scale, b_scale, m, n, kk, a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        B_KMAJOR=b_kmajor, B_GROUP_N=group_n, OUT_DTYPE=triton_dtype(c.dtype), OUT_BF16=c.dtype == torch.bfloat16,
        IMPRECISE_ACC=0 if precise else TILE, BLOCK_M=bm, BLOCK_N=bn, TILE=TILE,
        GROUP_M=TMA_GROUP_M, NUM_STAGES=stages, num_warps=warps)


def matmul(a, a_scale, b, b_scale, out_dtype=torch.bfloat16, block_m: int = 128, block_n: int = 128,
           precise: bool = False, tma: bool = True, tma_config: tuple | None = None):
    """a @ b of block-scaled fp8 operands (reference.matmul's contract); a and b may be transposes.
    On Hopper, each 128 of K is summed by the tensor cores at their reduced fp8 accumulation
    precision and then promoted into fp32 (DeepSeek-V3's scheme); precise=True promotes after every
    tensor-core instruction instead (the interpreter sums in fp32 either way). tma: the pipelined
    TMA kernel where the layouts allow it (a and c row-major, b row-major or a transpose, rows
    16-byte aligned), else the pointer kernel (block_m x block_n tiles), which takes any strides.
    tma_config: the TMA kernel's (BLOCK_M, BLOCK_N, stages, warps) in place of the defaults."""
    check_matmul(a, a_scale, b, b_scale)
    check_launchable(k.matmul_kernel, a.device)
    check_fp8_dots(a.device)
    (m, kk), n = a.shape, b.shape[1]
    group_n = 1 if b_scale.shape[1] == n else TILE
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if tma and m and n and _tma_path(a, b, c):
        _matmul_tma(a, a_scale, b, b_scale, c, group_n, precise, tma_config)
        return c
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    direct(k.matmul_kernel)[grid](
        a, a_scale, b, b_scale, c, m, n, kk, a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), b_scale.stride(0), b_scale.stride(1), c.stride(0), c.stride(1),
        B_GROUP_N=group_n, OUT_BF16=out_dtype == torch.bfloat16, IMPRECISE_ACC=0 if precise else TILE,
        BLOCK_M=block_m, BLOCK_N=block_n, TILE=TILE, num_warps=8, num_stages=3)
    return c
