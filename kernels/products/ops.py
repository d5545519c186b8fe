"""Raw block-sparse products (no autograd): argument checks, config choice and kernel launches.

  sdd(a, b, topology)                   sparse  = a @ b at the topology's blocks
  sdd_gelu(a, b, topology)              (h, gelu(h)) for that product, in one kernel
  dsd(data, topology, b)                dense   = S @ b        (transpose=True: S^T @ b;
                                        accumulate=True: out += the product)
  dds(a, data, topology)                dense   = a @ S        (transpose=True: a @ S^T)

Dense operands may be any strided view (a transposed weight, for instance); sparse data must be
contiguous [max_blocks, bs, bs]. Inputs are fp32, fp16 or bf16, all of one dtype; the kernels
accumulate in fp32 and return the input dtype. The sparse dimensions are multiples of the block size
by construction; the dense widths may be anything (the kernels mask the edges).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..activations import ops as activation
from ..launch import (
    cdiv,
    check_launchable,
    direct,
    dot_precision,
    persistent_programs,
    tma_descriptor,
    tma_ready,
    triton_dtype,
)
from .kernels import (
    dsd as _dsd_module,
    dsd_tma as _dsd_tma_module,
    dsdt_tma as _dsdt_tma_module,
    sdd as _sdd_module,
    sdd_tma as _sdd_tma_module,
)
from .topology import Topology
from .tuning import DsdConfig, SddConfig, dsd_config, sdd_config

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_operands(topology: Topology, op: str, **tensors: torch.Tensor) -> torch.dtype:
    dtype = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; use one of float32, float16, bfloat16")
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            names = ", ".join(f"{n}={v.dtype}" for n, v in tensors.items())
            raise TypeError(f"{op}: all operands must share one dtype, got {names}")
        if t.device != topology.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the topology is on {topology.device}")
    return dtype


def _check_2d(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")




def _check_accumulation_target(op: str, out: Optional[torch.Tensor], shape, dtype: torch.dtype,
                               device: torch.device) -> None:
    """out of an accumulating product: given, of the product's shape, fp32 or the operands' dtype,
    on the operands' device, row-major with unit inner stride (each element written by one program)."""
    if out is None:
        raise ValueError(f"{op}: accumulate=True adds into out; pass the tensor to accumulate into as out")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: out must have shape {tuple(shape)} to accumulate into, got {tuple(out.shape)}")
    if out.dtype not in (dtype, torch.float32):
        raise TypeError(f"{op}: out has dtype {out.dtype}; accumulation takes float32 or the operands' {dtype}")
    if out.device != device:
        raise ValueError(f"{op}: out is on {out.device} but the operands are on {device}")
    rows, cols = shape
    if (cols > 1 and out.stride(1) != 1) or (rows > 1 and out.stride(0) < cols):
        raise ValueError(
            f"{op}: out must be row-major with unit inner stride to accumulate into, got strides "
            f"{tuple(out.stride())}; pass a contiguous tensor (or a row slice of one)"
        )


def _sdd_checks(op: str, a: torch.Tensor, b: torch.Tensor, topology: Topology) -> torch.dtype:
    _check_2d(op, "a", a)
    _check_2d(op, "b", b)
    rows, cols = topology.shape
    if a.shape[0] != rows:
        raise ValueError(f"{op}: a has {a.shape[0]} rows but the sparse output has {rows} (topology.shape[0])")
    if b.shape[1] != cols:
        raise ValueError(f"{op}: b has {b.shape[1]} columns but the sparse output has {cols} (topology.shape[1])")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    return _check_operands(topology, op, a=a, b=b)


def _sdd_tma(a, b, topology: Topology, out, cfg: SddConfig, dtype, act=None) -> bool:
    """Launch the persistent TMA kernel (with act: its GELU epilogue, see kernels/sdd_tma.py) when it
    applies to these operands; False (nothing launched) when it does not."""
    K, regular, nb = a.shape[1], topology.blocks_per_row, cfg.blocks_per_program
    b_kmajor = tma_ready(b, transposed=True)
    if not (cfg.persistent and regular and K > 0 and tma_ready(a) and (b_kmajor or tma_ready(b)) and nb in (1, 2)):
        return False
    if topology.max_blocks == 0:
        return True
    bs = topology.block_size
    b_mat = b.t() if b_kmajor else b
    b_block = [nb * bs, cfg.block_k] if b_kmajor else [cfg.block_k, nb * bs]
    grid = min(persistent_programs(a.device, cfg.programs_per_sm), topology.max_blocks // nb)
    direct(_sdd_tma_module.sdd_tma_kernel)[(grid,)](
        tma_descriptor(a, [bs, cfg.block_k]), tma_descriptor(b_mat, b_block),
        tma_descriptor(out.view(-1, bs), [bs, bs]),
        topology.column_indices, topology.nnz,
        K, regular, grid,
        None if act is None else tma_descriptor(act.view(-1, bs), [bs, bs]),
        BS=bs, NB=nb, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        B_KMAJOR=b_kmajor, FLATTEN=cfg.flatten, OUT_DTYPE=triton_dtype(dtype),
        DOT_PRECISION=dot_precision(dtype, a.device), GELU_OUT=act is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return True


def _sdd_config(a: torch.Tensor, topology: Topology, config: Optional[SddConfig], dtype, op: str) -> SddConfig:
    regular = topology.blocks_per_row
    cfg = config or sdd_config(topology.block_size, regular, a.shape[1], a.device, dtype)
    nb = cfg.blocks_per_program
    if nb > 1 and not (regular and regular % nb == 0):
        raise ValueError(
            f"{op}: blocks_per_program={nb} needs a regular topology whose rows hold a multiple of {nb} blocks"
        )
    return cfg


def sdd(
    a: torch.Tensor,
    b: torch.Tensor,
    topology: Topology,
    out: Optional[torch.Tensor] = None,
    config: Optional[SddConfig] = None,
) -> torch.Tensor:
    """Blocks of a @ b at the topology's nonzero blocks: a [rows, K], b [K, cols] -> data."""
    op = "sdd"
    dtype = _sdd_checks(op, a, b, topology)
    if out is None:
        out = topology.empty_data(dtype)
    else:
        topology.check_data(out, "out")
        if not out.is_contiguous() or out.dtype != dtype:
            raise ValueError(f"{op}: out must be contiguous with dtype {dtype}")
    kernel = _sdd_module.sdd_kernel
    check_launchable(kernel, a.device)
    cfg = _sdd_config(a, topology, config, dtype, op)
    if _sdd_tma(a, b, topology, out, cfg, dtype):
        return out
    nb, bs, regular = cfg.blocks_per_program, topology.block_size, topology.blocks_per_row
    num_programs = topology.max_blocks // nb
    if num_programs == 0:
        return out
    K = a.shape[1]
    direct(kernel)[(num_programs,)](
        a, b, out,
        topology.row_indices, topology.column_indices, topology.nnz,
        K, regular or 1,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BS=bs, NB=nb, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        REGULAR=bool(regular), EVEN_K=(K % cfg.block_k == 0),
        DOT_PRECISION=dot_precision(dtype, a.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def sdd_gelu(a: torch.Tensor, b: torch.Tensor, topology: Topology,
             config: Optional[SddConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h, gelu(h)) for h = sdd(a, b, topology), GELU taken of h as stored (in its dtype), as
    activation_forward computes it. One kernel where the persistent TMA kernel applies (a dMoE
    topology on Hopper, or the interpreter), else the product and the activation pass."""
    dtype = _sdd_checks("sdd_gelu", a, b, topology)
    cfg = _sdd_config(a, topology, config, dtype, "sdd_gelu")
    h, act = topology.empty_data(dtype), topology.empty_data(dtype)
    check_launchable(_sdd_tma_module.sdd_tma_kernel, a.device)
    if _sdd_tma(a, b, topology, h, cfg, dtype, act=act):
        return h, act
    sdd(a, b, topology, out=h, config=config)
    return h, activation.activation_forward("gelu", h, None, topology.nnz)


def dsd(
    data: torch.Tensor,
    topology: Topology,
    b: torch.Tensor,
    transpose: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[DsdConfig] = None,
    accumulate: bool = False,
    slot: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense S @ b (S^T @ b when transpose) for the sparse S = (data, topology).

    slot (S @ b only): an int32 [1] device tensor; data is then stacked sparse data [W, *the
    topology's data shape] and S is data[slot], the slot read by the kernel (a weight-gradient window's slots, where
    the activation's backward stored S: products/window.py).

    accumulate=True adds the product to out (required) in the kernel's epilogue: out += S @ b, the
    fp32 accumulator added to out's old values before the store. out is then float32 (a weight
    gradient's fp32 main_grad under 16-bit operands) or the operands' dtype, row-major with unit
    inner stride. Without accumulate, out may also be such a float32 tensor under 16-bit operands:
    the product is stored into it unrounded, and out's old values are never read.
    """
    op = "dsd"
    _check_2d(op, "b", b)
    stacked = None
    if slot is not None:
        if transpose:
            raise ValueError(f"{op}: slot is for S @ b (transpose=False)")
        if slot.numel() != 1 or slot.dtype != torch.int32 or slot.device != data.device or data.dim() != 4:
            raise ValueError(f"{op}: slot must be an int32 [1] tensor on {data.device} beside stacked data "
                             f"[W, blocks, bs, bs], got {tuple(slot.shape)} {slot.dtype}, data {tuple(data.shape)}")
        stacked, data = data.contiguous(), data[0]
    topology.check_data(data, "data")
    s_rows, s_cols = topology.transposed_shape() if transpose else topology.shape
    if b.shape[0] != s_cols:
        which = "S^T" if transpose else "S"
        raise ValueError(f"{op}: b has {b.shape[0]} rows but {which} has {s_cols} columns")
    dtype = _check_operands(topology, op, data=data, b=b)
    N = b.shape[1]
    # out in fp32 under 16-bit operands ("wide"): checked as an accumulation target is, and written
    # by the pointer epilogue (or, from the weight-gradient kernel, by TMA strips)
    wide_out = out is not None and out.dtype == torch.float32 and dtype != torch.float32
    if accumulate or wide_out:
        _check_accumulation_target(op, out, (s_rows, N), dtype, b.device)
    elif out is None:
        out = torch.empty((s_rows, N), dtype=dtype, device=b.device)
    elif tuple(out.shape) != (s_rows, N) or out.dtype != dtype:
        raise ValueError(
            f"{op}: out must have shape {(s_rows, N)} and dtype {dtype} (or float32), got {tuple(out.shape)} "
            f"{out.dtype}"
        )
    data = data.contiguous()
    # the kernels read S from slot `*slot` of the stacked data, or from data (slot_ptr unused)
    from_slot = dict(slot_ptr=slot if stacked is not None else topology.nnz, FROM_SLOT=stacked is not None)
    s_all = stacked if stacked is not None else data
    kernel = _dsd_module.dsd_kernel
    check_launchable(kernel, b.device)
    bs = topology.block_size
    out_block_rows = s_rows // bs
    cfg = config or dsd_config(bs, N, transpose, b.device, bool(topology.blocks_per_row), dtype)
    if bs % cfg.block_k != 0:
        raise ValueError(f"{op}: block_k={cfg.block_k} must divide the block size {bs}")
    num_programs = out_block_rows * cdiv(N, cfg.block_n)
    if num_programs == 0:
        return out
    if transpose:
        offsets, indices, positions = topology.column_offsets, topology.row_indices_t, topology.block_offsets_t
    else:
        offsets, indices, positions = topology.offsets, topology.column_indices, topology.column_indices
    regular = topology.blocks_per_row
    # Accumulation (and a wide out) goes through pointers, so out needs no TMA layout then.
    pointers = accumulate or wide_out
    if cfg.persistent and regular and tma_ready(b) and (pointers or tma_ready(out)) and topology.max_blocks > 0:
        s_block = [cfg.block_k, bs] if transpose else [bs, cfg.block_k]
        grid = min(persistent_programs(b.device, cfg.programs_per_sm), num_programs)
        # the weight-gradient kernel stores a wide out through TMA, in column strips (adding through TMA
        # measured no faster than the pointer epilogue)
        strip = min(64, cfg.block_n)
        # the kernels take every epilogue argument (no defaults: a launch torch.compile traces,
        # launch.direct, applies none)
        epilogue = dict(c_ptr=None, stride_cm=None, ACCUMULATE=False, OVERWRITE=False)
        strips = 0
        if wide_out and not accumulate and transpose and cfg.flatten and tma_ready(out):
            strips = cfg.block_n // strip
            c_desc = tma_descriptor(out, [bs, strip])
        elif pointers:
            epilogue = dict(c_ptr=out, stride_cm=out.stride(0), ACCUMULATE=True, OVERWRITE=not accumulate)
            c_desc = None
        else:
            c_desc = tma_descriptor(out, [bs, cfg.block_n])
        if transpose and cfg.flatten:  # uneven K per tile: loops fused by hand
            direct(_dsdt_tma_module.dsdt_tma_kernel)[(grid,)](
                tma_descriptor(data.view(-1, bs), s_block), tma_descriptor(b, [cfg.block_k, cfg.block_n]),
                c_desc,
                offsets, indices, positions,
                N, out_block_rows, regular, grid, data.shape[0] * bs, b.shape[0],
                BS=bs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                OUT_DTYPE=triton_dtype(dtype), DOT_PRECISION=dot_precision(dtype, b.device),
                COUNT_CHUNK=_dsdt_tma_module.TILE_COUNT_CHUNK, STRIPS=strips,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **epilogue,
            )
            return out
        direct(_dsd_tma_module.dsd_tma_kernel)[(grid,)](
            tma_descriptor(s_all.view(-1, bs), s_block), tma_descriptor(b, [cfg.block_k, cfg.block_n]),
            c_desc,
            offsets, indices, positions, topology.nnz,
            N, out_block_rows, regular, grid,
            BS=bs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            TRANS_S=transpose, FLATTEN=cfg.flatten, OUT_DTYPE=triton_dtype(dtype),
            DOT_PRECISION=dot_precision(dtype, b.device),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **epilogue,
            slot_rows=data.shape[0] * bs, **from_slot,
        )
        return out
    direct(kernel)[(num_programs,)](
        s_all, b, out,
        offsets, indices, positions,
        N, out_block_rows, topology.blocks_per_row or 1,
        b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BS=bs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        TRANS_S=transpose, REGULAR=bool(topology.blocks_per_row), EVEN_N=(N % cfg.block_n == 0),
        DOT_PRECISION=dot_precision(dtype, b.device),
        ACCUMULATE=accumulate, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        slot_elements=data.numel(), **from_slot,
    )
    return out


def dds(
    a: torch.Tensor,
    data: torch.Tensor,
    topology: Topology,
    transpose: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[DsdConfig] = None,
) -> torch.Tensor:
    """Dense a @ S (a @ S^T when transpose), computed as (S^T @ a^T)^T by the DSD kernel."""
    op = "dds"
    _check_2d(op, "a", a)
    s_rows, s_cols = topology.transposed_shape() if transpose else topology.shape
    if a.shape[1] != s_rows:
        which = "S^T" if transpose else "S"
        raise ValueError(f"{op}: a has {a.shape[1]} columns but {which} has {s_rows} rows")
    dtype = _check_operands(topology, op, a=a, data=data)
    if out is None:
        out = torch.empty((a.shape[0], s_cols), dtype=dtype, device=a.device)
    elif tuple(out.shape) != (a.shape[0], s_cols):
        raise ValueError(f"{op}: out must have shape {(a.shape[0], s_cols)}, got {tuple(out.shape)}")
    dsd(data, topology, a.t(), transpose=not transpose, out=out.t(), config=config)
    return out
