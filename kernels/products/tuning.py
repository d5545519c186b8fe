"""Launch configurations of the kernels, chosen per shape.

A config is a small frozen dataclass; ``sdd_config`` and ``dsd_config`` pick one from the block
size, the dense width and the device. The Hopper choices come from measurements on an H200
(tools/bench_kernels.py; docs/kernels.md, "Tile configurations"). Callers may pass their own config to
the raw ops (the benchmark does, to sweep).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SddConfig:
    blocks_per_program: int = 1  # neighbouring blocks of one row computed together (needs regular rows)
    block_k: int = 64
    group_m: int = 8  # block rows walked together for L2 reuse (regular topologies)
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False  # TMA persistent kernel (regular topologies, TMA-friendly operands)
    programs_per_sm: int = 1  # persistent grid size per multiprocessor
    flatten: bool = True  # fuse the tile and K loops into one pipeline (persistent only)


@dataclass(frozen=True)
class DsdConfig:
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    programs_per_sm: int = 1
    flatten: bool = True


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _is_hopper_or_newer(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


# fp32 operands take twice the shared memory of 16-bit ones per tile: the 16-bit Hopper configs
# (pipelines tuned to fill the 227 KB) do not fit, so fp32 gets single-block tiles, half the K
# step and 3 stages (about 160 KB). fp32 on a GPU serves checks, not speed.
_FP32_SDD = SddConfig(blocks_per_program=1, block_k=32, group_m=8, num_warps=4, num_stages=3)
_FP32_DSD = DsdConfig(block_n=128, block_k=32, group_m=8, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=None)  # called at every launch: the choice is a pure function of its arguments
def sdd_config(block_size: int, blocks_per_row, K: int, device: torch.device,
               dtype: torch.dtype = torch.bfloat16) -> SddConfig:
    """Config of SDD for a topology (block size, regular row length or None), inner width K and
    operand dtype."""
    if device.type == "cuda" and dtype == torch.float32:
        return replace(_FP32_SDD, block_k=min(_FP32_SDD.block_k, block_size),
                       persistent=bool(blocks_per_row) and _is_hopper_or_newer(device))
    if device.type != "cuda":
        # Interpreter: small tiles keep tests quick; the same kernels as on a GPU otherwise.
        nb = 2 if blocks_per_row and blocks_per_row % 2 == 0 else 1
        return SddConfig(blocks_per_program=nb, block_k=min(block_size, 32), group_m=2, persistent=bool(blocks_per_row))
    block_k = 64 if block_size >= 64 else block_size
    if blocks_per_row and _is_hopper_or_newer(device):
        # Two neighbouring blocks per tile (128 x 256 at bs 128: wgmma's efficient shape),
        # persistent, tile and K loops fused. A short K (the model width) wants a deeper pipeline:
        # measured on an H200 (docs/kernels.md, "Tile configurations").
        nb = 2 if blocks_per_row % 2 == 0 else 1
        warps = 8 if block_size * nb * block_size >= 128 * 256 else 4
        return SddConfig(blocks_per_program=nb, block_k=block_k, group_m=8, num_warps=warps,
                         num_stages=4 if K <= 1024 else 3, persistent=True)
    nb = 2 if blocks_per_row and blocks_per_row % 2 == 0 and block_size == 128 else 1
    return SddConfig(blocks_per_program=nb, block_k=block_k, group_m=8, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=None)
def dsd_config(block_size: int, N: int, transpose: bool, device: torch.device, regular: bool = False,
               dtype: torch.dtype = torch.bfloat16) -> DsdConfig:
    """Config of DSD (and DDS through it) for a block size, output width N, orientation and dtype."""
    if device.type == "cuda" and dtype == torch.float32:
        return replace(_FP32_DSD, block_k=min(_FP32_DSD.block_k, block_size),
                       persistent=regular and _is_hopper_or_newer(device))
    if device.type != "cuda":
        return DsdConfig(block_n=32, block_k=min(block_size, 16), group_m=2, persistent=regular)
    block_k = 64 if block_size >= 64 else block_size
    if regular and _is_hopper_or_newer(device):
        # Persistent TMA kernels, tile and K loops fused (by the compiler for S @ B, whose K bound
        # is the same for every tile; by hand for S^T @ B). 128 x 256 tiles on two warpgroups.
        if block_size == 128 and N >= 256:
            return DsdConfig(block_n=256, block_k=block_k, group_m=8, num_warps=8, num_stages=3, persistent=True)
        if block_size == 64 and N >= 256:
            return DsdConfig(block_n=256, block_k=block_k, group_m=8, num_warps=4, num_stages=4, persistent=True)
        return DsdConfig(block_n=128, block_k=block_k, group_m=8, num_warps=4, num_stages=4, persistent=True)
    # Generic kernel (any topology): 128 x 128 tiles on one warpgroup measured best on an H200.
    return DsdConfig(block_n=128, block_k=block_k, group_m=8, num_warps=4, num_stages=4)
