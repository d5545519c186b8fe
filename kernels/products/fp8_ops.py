"""Block-sparse products of block-scaled fp8 operands (kernels/sparse_fp8.py), for dMoE topologies:
the expert MLP's forward and input-gradient products in DeepSeek-V3's recipe (dmoe_kernels.fp8).

  quantize_blocks_rows(data)          sparse data -> (e4m3 data, one scale per row of each block)
  sdd_fp8(a, a_scale, w, w_scale, topology)
                                      sparse a @ w^T at the topology's blocks; a [rows, K] in 1 x 128
                                      row tiles, w [cols, K] (a weight as stored) in 128 x 128 blocks
  dsd_fp8(q, q_scale, topology, b, b_scale)
                                      dense S @ b; S's blocks with their row scales, b [K, N] in
                                      128 x 128 blocks (the weight w [cols, N] as stored)

Where the layer uses them: h = x @ w1^T (sdd_fp8), y = act @ w2 (dsd_fp8), da = dy @ w2^T
(sdd_fp8 with w2) and dx = dh @ w1 (dsd_fp8 with w1). Results are bf16 (or the out_dtype asked);
the reference is dmoe_kernels.fp8.reference.matmul on the dense operands, restricted to the blocks.
On CUDA they need Hopper (TMA, fp8 tensor cores); on CPU they run under Triton's interpreter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..fp8 import ops as fp8_ops
from ..fp8.reference import FP8, TILE, tiles
from ..launch import check_launchable, direct, persistent_programs, tma_descriptor, tma_ready, triton_dtype
from .kernels import sparse_fp8 as _kernels
from .topology import Topology

GROUP_M = 8


class Fp8Config(NamedTuple):
    """A persistent fp8 product's tiles. sdd: width = neighbouring blocks per tile; dsd: width =
    BLOCK_N columns. split: tiles per block row (rows BS / split); per_sm: programs per SM."""
    width: int
    split: int
    stages: int
    warps: int
    per_sm: int

    @classmethod
    def parse(cls, text: str) -> "Fp8Config":
        """'WIDTH:SPLIT:STAGES:WARPS:PER_SM' (tools' --configs)."""
        parts = text.split(":")
        if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"an fp8 product config is WIDTH:SPLIT:STAGES:WARPS:PER_SM (positive integers), "
                             f"got {text!r}")
        return cls(*(int(p) for p in parts))


# the defaults (tools/bench_fp8_experts.py --sdd-configs/--dsd-configs; docs/kernels.md, "Block-scaled fp8
# products"): 64 x 128 tiles, 3 stages, 4 warps, two programs per multiprocessor
SDD_CONFIG = Fp8Config(1, 2, 3, 4, 2)
DSD_CONFIG = Fp8Config(128, 2, 3, 4, 2)


def _check(op: str, topology: Topology, **tensors) -> None:
    if not topology.blocks_per_row:
        raise ValueError(f"{op}: needs a dMoE topology (Topology.for_experts: blocks_per_row set)")
    for name, t in tensors.items():
        if t.device != topology.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the topology is on {topology.device}")
        if name.endswith("scale"):
            if t.dtype != torch.float32:
                raise ValueError(f"{op}: {name} must be float32, got {t.dtype}")
        elif t.dtype != FP8:
            raise ValueError(f"{op}: {name} must be float8_e4m3fn (dmoe_kernels.fp8's quantization), got {t.dtype}")
    if topology.device.type == "cuda" and torch.cuda.get_device_capability(topology.device)[0] < 9:
        raise RuntimeError(f"{op}: the fp8 block-sparse kernels need Hopper (TMA and fp8 tensor cores); "
                           "use bf16 on this GPU")


def _split(split: int, bs: int) -> int:
    """Tiles per block row: rows of at least 16 (the tensor cores' smallest), a power of two."""
    if split & (split - 1):
        raise ValueError(f"fp8 products: split must be a power of two, got {split}")
    return min(split, max(1, bs // 16))


def quantize_blocks_rows(data: torch.Tensor):
    """Sparse data [max_blocks, bs, bs] -> (e4m3 data of the same shape, fp32 scales [max_blocks * bs]:
    one per row of each block, the 1 x bs tile along K that dsd_fp8 takes). Blocks past nnz are
    quantized too (their values are undefined, and never read)."""
    if data.dim() != 3 or data.shape[1] != data.shape[2]:
        raise ValueError(f"quantize_blocks_rows: sparse data must be [max_blocks, bs, bs], got {tuple(data.shape)}")
    q, s = fp8_ops.quantize_rows(data.reshape(-1, data.shape[2]))
    return q.view(data.shape), s.reshape(-1)


def sdd_fp8(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, topology: Topology,
            out_dtype: torch.dtype = torch.bfloat16, precise: bool = False,
            config: Fp8Config | None = None) -> torch.Tensor:
    """Blocks of a @ w^T at the topology: a [rows, K] e4m3 with scales [rows, ceil(K/128)], w [cols, K]
    e4m3 with scales [ceil(cols/128), ceil(K/128)] -> sparse data in out_dtype. precise: fp32 sums
    after every tensor-core instruction (else after each 128 of K, DeepSeek-V3's promotion)."""
    op = "sdd_fp8"
    _check(op, topology, a=a, a_scale=a_scale, w=w, w_scale=w_scale)
    rows, cols = topology.shape
    if a.dim() != 2 or w.dim() != 2 or a.shape[0] != rows or w.shape[0] != cols or a.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: expects a [{rows}, K] and w [{cols}, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    K = a.shape[1]
    if tuple(a_scale.shape) != (rows, tiles(K)) or tuple(w_scale.shape) != (tiles(cols), tiles(K)):
        raise ValueError(f"{op}: scales must be a's [{rows}, {tiles(K)}] and w's [{tiles(cols)}, {tiles(K)}], got "
                         f"{tuple(a_scale.shape)} and {tuple(w_scale.shape)}")
    if not (tma_ready(a) and tma_ready(w)) or w_scale.stride(1) != 1:
        raise ValueError(f"{op}: a, w and w's scales must be row-major with rows of a multiple of 16 bytes "
                         f"(K = {K} must be a multiple of 16)")
    bs, F = topology.block_size, topology.blocks_per_row
    cfg = config or SDD_CONFIG
    nb = cfg.width if F % cfg.width == 0 else 1
    split = _split(cfg.split, bs)
    out = topology.empty_data(out_dtype)
    check_launchable(_kernels.sdd_fp8_kernel, a.device)
    if topology.max_blocks == 0:
        return out
    grid = min(persistent_programs(a.device, cfg.per_sm), topology.max_blocks // nb * split)
    sub = bs // split
    direct(_kernels.sdd_fp8_kernel)[(grid,)](
        tma_descriptor(a, [sub, TILE]), tma_descriptor(w, [nb * bs, TILE]), tma_descriptor(out.view(-1, bs), [sub, bs]),
        a_scale, w_scale, topology.column_indices, topology.nnz,
        K, F, grid, a_scale.stride(0), a_scale.stride(1), w_scale.stride(0),
        BS=bs, NB=nb, SPLIT=split, TILE=TILE, GROUP_M=GROUP_M, FLATTEN=True, OUT_DTYPE=triton_dtype(out_dtype),
        IMPRECISE_ACC=0 if precise else TILE, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out


def dsd_fp8(q: torch.Tensor, q_scale: torch.Tensor, topology: Topology, b: torch.Tensor, b_scale: torch.Tensor,
            out_dtype: torch.dtype = torch.bfloat16, precise: bool = False,
            config: Fp8Config | None = None) -> torch.Tensor:
    """Dense S @ b: S = (q, topology) with q_scale [max_blocks * bs] (quantize_blocks_rows), b [K, N]
    e4m3, row-major or the transpose of a row-major [N, K] (faster: the tensor cores read b
    K-major), with scales [ceil(K/128), ceil(N/128)] (any strides) -> [rows, N] in out_dtype; the
    rows past the used ones are zeros (as ops.dsd gives them)."""
    op = "dsd_fp8"
    _check(op, topology, q=q, q_scale=q_scale, b=b, b_scale=b_scale)
    topology.check_data(q, "q")
    rows, K = topology.shape
    bs = topology.block_size
    if bs < 32 and topology.device.type == "cuda":  # a K step is one block
        raise ValueError(f"{op}: fp8 tensor cores take K steps of at least 32; this topology's blocks are {bs} wide")
    if b.dim() != 2 or b.shape[0] != K:
        raise ValueError(f"{op}: b must be [{K}, N], got {tuple(b.shape)}")
    N = b.shape[1]
    if tuple(q_scale.shape) != (topology.max_blocks * bs,) or tuple(b_scale.shape) != (tiles(K), tiles(N)):
        raise ValueError(f"{op}: scales must be q's [{topology.max_blocks * bs}] and b's [{tiles(K)}, {tiles(N)}], "
                         f"got {tuple(q_scale.shape)} and {tuple(b_scale.shape)}")
    out = torch.empty(rows, N, dtype=out_dtype, device=b.device)
    b_kmajor = tma_ready(b, transposed=True)
    if not (q.is_contiguous() and (b_kmajor or tma_ready(b)) and tma_ready(out)):
        raise ValueError(f"{op}: q must be contiguous, b and the output row-major (b may be a transpose) with "
                         f"rows of a multiple of 16 bytes (N = {N})")
    check_launchable(_kernels.dsd_fp8_kernel, b.device)
    cfg = config or DSD_CONFIG
    block_n = min(cfg.width, max(16, 1 << (N - 1).bit_length()))
    split = _split(cfg.split, bs)
    sub = bs // split
    tiles_total = (rows // bs) * split * -(-N // block_n)
    if tiles_total == 0:
        return out
    grid = min(persistent_programs(b.device, cfg.per_sm), tiles_total)
    b_desc = tma_descriptor(b.t(), [block_n, bs]) if b_kmajor else tma_descriptor(b, [bs, block_n])
    direct(_kernels.dsd_fp8_kernel)[(grid,)](
        tma_descriptor(q.view(-1, bs), [sub, bs]), b_desc,
        tma_descriptor(out, [sub, block_n]), q_scale, b_scale, topology.column_indices, topology.nnz,
        N, rows // bs, topology.blocks_per_row, grid, b_scale.stride(0), b_scale.stride(1),
        BS=bs, BLOCK_N=block_n, SPLIT=split, B_KMAJOR=b_kmajor, TILE=TILE, GROUP_M=GROUP_M,
        OUT_DTYPE=triton_dtype(out_dtype), IMPRECISE_ACC=0 if precise else min(TILE, bs),  # a step is one block
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out
