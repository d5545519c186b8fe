"""Block-scaled fp8 products through cuBLAS (torch._scaled_mm), where this torch and GPU take
DeepSeek-V3's scales (1 x 128 on a's rows, 128 x 128 on b's blocks) and read them right.

cuBLAS wants a row-major and b column-major (b the transpose of a row-major weight [N, K]), a's
scales M-major ([M, K/128] with strides (1, M): as quantize_rows stores them) and b's as
[K/128, N/128] with strides (1, K/128). torch 2.11 refuses those unless K/128 is a multiple of 4,
and reads padded scale rows wrongly (docs/kernels.md, "Block-scaled fp8 products"), so
`supported` asks for that; a one-time probe against the pure-torch product checks the rest on
this torch and GPU. Measured 1.5-1.6x bf16 at those widths, where the Triton product gives
1.1-1.2x.
"""
from __future__ import annotations

import functools

import torch

from .reference import FP8, TILE, tiles

K_TILES_MULTIPLE = 4  # K / 128 must be a multiple of this (cuBLAS's scale layout)


@functools.lru_cache(maxsize=None)
def probe(device_index: int) -> bool:
    """Whether torch._scaled_mm computes block-scaled products right on this GPU (a small product
    against reference.matmul on the same fp8 operands). It reads its answer back to the host: a
    model that will be captured into CUDA graphs calls it before the capture."""
    from . import reference

    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(64, 512, device=dev, generator=gen)
    w = torch.randn(256, 512, device=dev, generator=gen) * 0.05
    aq, sa = reference.quantize_rows(a)
    wq, ws = reference.quantize_blocks(w)
    try:
        got = _scaled_mm(aq, sa, wq.t(), ws.t(), torch.float32)
    except (RuntimeError, TypeError, ValueError):  # a torch or cuBLAS without block scales
        return False
    want = reference.matmul(aq, sa, wq.t(), ws.t(), torch.float32)
    return bool(((got - want).abs().max() <= 1e-3 * want.abs().max()).item())


def takes(m: int, k: int, n: int, device: torch.device) -> bool:
    """Can cuBLAS take an [M, K] @ [K, N] product with block scales here, in the layouts it wants?"""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    if tiles(k) % K_TILES_MULTIPLE or k % TILE or n % 16 or m % 16:  # torch's 16-multiples
        return False
    return probe(device.index if device.index is not None else torch.cuda.current_device())


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can cuBLAS take a @ b as given: fp8 a [M, K] row-major, b [K, N] column-major?"""
    return a.stride(1) == 1 and b.stride(0) == 1 and takes(a.shape[0], *b.shape, a.device)


def _scaled_mm(a, a_scale, b, b_scale, out_dtype):
    scale_a = a_scale if a_scale.stride(0) == 1 else a_scale.t().contiguous().t()
    scale_b = b_scale.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=False)


def matmul(a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    """a @ b (reference.matmul's contract with b's 128 x 128 block scales) through cuBLAS; callers
    check `supported(a, b)` first."""
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8 cuBLAS matmul: operands must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    return _scaled_mm(a, a_scale, b, b_scale, out_dtype)
