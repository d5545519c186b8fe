"""Block-scaled fp8 (e4m3) in pure torch, as DeepSeek-V3 trains: the tests' ground truth, and the
path that runs where the Triton kernels cannot (CPU without the interpreter).

Scaling: one fp32 scale per tile, scale = amax / 448 (e4m3's largest finite value), the tile
divided by it and rounded to nearest (ties to even) into torch.float8_e4m3fn. Tiles:
  rows (1 x 128)      activations and gradients: one scale per row per 128 columns (along K)
  blocks (128 x 128)  weights: one scale per 128 x 128 block, so that W and W^T share them
Widths that are not multiples of 128 end in a narrower tile with a scale of its own.

matmul: a [M, K] with row scales [M, ceil(K/128)] times b [K, N] with block scales
[ceil(K/128), ceil(N/128)] or column scales [ceil(K/128), N] (b^T's rows: the weight gradient's
operands); each 128 of K is summed in fp32 and promoted into the fp32 accumulator with its scales.
"""
from __future__ import annotations

import torch

TILE = 128
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
# An all-zero tile would get scale 0 (and 0 / 0 = NaN): its amax is raised to this floor, a power
# of two whose amax / 448 is still a normal fp32 number. Tiles above it are scaled exactly by amax.
AMAX_FLOOR = 2.0**-100


def tiles(n: int) -> int:
    return -(-n // TILE)


def _padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    pad = tiles(x.shape[dim]) * TILE - x.shape[dim]
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor: on CUDA, torch turns a division by a Python number into a product with
    # its reciprocal, one rounding off the correctly rounded quotient that the kernels compute
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / torch.full_like(amax, E4M3_MAX)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x / scale can exceed 448 by an fp32 rounding; clamped, it stays finite
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def check_float(x: torch.Tensor, what: str, dims: int) -> None:
    if not x.is_floating_point() or x.dtype in (FP8, torch.float8_e5m2):
        raise ValueError(f"{what}: expects a float32/bfloat16/float16 tensor, got {x.dtype}")
    if dims and x.dim() != dims:
        raise ValueError(f"{what}: expects a {dims}-d tensor, got shape {tuple(x.shape)}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{what}: expects a non-empty last dimension, got shape {tuple(x.shape)}")


def quantize_rows(x: torch.Tensor):
    """x [..., K] -> (q [..., K] float8_e4m3fn, scales [..., ceil(K/128)] fp32): 1 x 128 tiles."""
    check_float(x, "quantize_rows", 0)
    k = x.shape[-1]
    t = _padded(x, -1).unflatten(-1, (-1, TILE))
    scale = scales_from_amax(t.abs().amax(-1))
    q = _to_fp8(t, scale[..., None]).flatten(-2)[..., :k]
    return q, scale


def quantize_blocks(w: torch.Tensor):
    """w [R, C] -> (q [R, C] float8_e4m3fn, scales [ceil(R/128), ceil(C/128)] fp32): 128 x 128 blocks."""
    check_float(w, "quantize_blocks", 2)
    r, c = w.shape
    t = _padded(_padded(w, 0), 1).unflatten(1, (-1, TILE)).unflatten(0, (-1, TILE))  # [RB, 128, CB, 128]
    scale = scales_from_amax(t.abs().amax((1, 3)))
    q = _to_fp8(t, scale[:, None, :, None]).flatten(2).flatten(0, 1)[:r, :c]
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    k = q.shape[-1]
    return (q.to(dtype) * scale.to(dtype).repeat_interleave(TILE, -1)[..., :k])


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    r, c = q.shape
    s = scale.to(dtype).repeat_interleave(TILE, 0)[:r].repeat_interleave(TILE, 1)[:, :c]
    return q.to(dtype) * s


def column_scales(b_scale: torch.Tensor, n: int) -> torch.Tensor:
    """b's scales as [ceil(K/128), N], one per column per 128 of K, from either of b's layouts."""
    if b_scale.shape[1] == n:
        return b_scale
    if b_scale.shape[1] == tiles(n):
        return b_scale.repeat_interleave(TILE, 1)[:, :n]
    raise ValueError(f"fp8 matmul: b's scales must be [ceil(K/128), ceil(N/128)] or [ceil(K/128), N] "
                     f"for N = {n}, got {tuple(b_scale.shape)}")


def check_matmul(a, a_scale, b, b_scale) -> None:
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8 matmul: operands must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8 matmul: expects a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    if tuple(a_scale.shape) != (m, tiles(k)):
        raise ValueError(f"fp8 matmul: a's scales must be [M, ceil(K/128)] = [{m}, {tiles(k)}], "
                         f"got {tuple(a_scale.shape)}")
    if b_scale.dim() != 2 or b_scale.shape[0] != tiles(k):
        raise ValueError(f"fp8 matmul: b's scales must have ceil(K/128) = {tiles(k)} rows, got "
                         f"{tuple(b_scale.shape)}")
    column_scales(b_scale, b.shape[1])
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError(f"fp8 matmul: scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")


def matmul(a, a_scale, b, b_scale, out_dtype=torch.bfloat16) -> torch.Tensor:
    """a @ b of block-scaled fp8 operands: each 128 of K summed in fp32 (the fp8 products are exact
    there), then scaled and added to an fp32 accumulator; rounded to out_dtype at the end."""
    check_matmul(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[1]
    sb = column_scales(b_scale, n).float()
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(tiles(k)):
        part = a[:, kb * TILE:(kb + 1) * TILE].float() @ b[kb * TILE:(kb + 1) * TILE].float()
        acc += part * a_scale[:, kb, None] * sb[kb]
    return acc.to(out_dtype)
