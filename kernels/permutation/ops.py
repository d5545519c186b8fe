"""The dMoE permutation without autograd: routing positions on the device, the two fused kernels, and
the regrouping of several micro-batches' rows by expert (the per-step weight gradients).

A token's K routed copies live in the expert-grouped, block-padded buffer [rows, H] used by the
block-sparse products: expert e's group starts at row ``expert_offsets[e]`` (a multiple of the block
size) and holds its ``counts[e]`` copies in token order, then zero rows up to the next block.

  padded_positions(indices, counts, expert_offsets)   pos [T, K] int32: row of copy (t, j)
  grouped_positions(counts, expert_offsets, num_rows)  pos [N, 1] for rows already grouped by expert
  expert_counts(indices, num_experts)                  counts [E] of every routed copy
  expand(src, pos, rows, expert_offsets, counts, scale=None, other=None, out=None, scale_rows=None)
      out[pos[t, j]] = scale[t, j] * src[t], padding rows zeroed; with ``other`` also returns
      dot[t, j] = <src[t], other[pos[t, j]]> (fp32)
  reduce(src, pos, scale=None, copy=None, partials=None)
                                                      dst[t] = sum_j scale[t, j] * src[pos[t, j]]; with
      partials [rows, C] fp32 also returns row_sums[t, j] = sum_c partials[pos[t, j], c]

  regroup_by_expert(topologies)                        the topology of several micro-batches' rows
                                                       regrouped by expert, and where each row comes from
  gather_block_rows(tensors, source_tensor, source_row, rows)   those rows copied into one tensor
  summed_transposed_products(datas, topologies, dense, out)     out += sum_m S_m^T @ B_m, one product

Everything is sized by host-known bounds (T*K copies, ``rows`` from ``max_padded_rows``) and reads
counts and offsets on the device: nothing comes back to the host. Rows of ``expand``'s output past
the used ones (``expert_offsets[-1]``) are left undefined; the block-sparse products never read them.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..launch import cdiv, check_launchable, direct, next_power_of_2
from ..products.topology import Topology, _expert_arrays_torch, _expert_arrays_triton
from .kernels import permute as _kernels, regroup as _regroup_kernels

_TILE_ELEMENTS = 4096  # elements of one program's [K, BLOCK_H] tile: 32 per thread at 4 warps


def _check_device(device: torch.device) -> None:
    check_launchable(_kernels.reduce_kernel, device)


def _block_h(H: int, k_pow2: int) -> int:
    return max(16, min(next_power_of_2(max(H, 1)), _TILE_ELEMENTS // k_pow2))


def _check_positions(op: str, pos: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if pos.dim() != 2 or pos.shape[0] != num_tokens:
        raise ValueError(f"{op}: pos must be [{num_tokens}, top_k], got shape {tuple(pos.shape)}")
    if pos.dtype not in (torch.int32, torch.int64) or pos.device != device:
        raise ValueError(f"{op}: pos must be an int32 or int64 tensor on {device}, got {pos.dtype} on {pos.device}")


def _check_scale(op: str, scale: Optional[torch.Tensor], pos: torch.Tensor) -> Optional[torch.Tensor]:
    if scale is None:
        return None
    if tuple(scale.shape) != tuple(pos.shape) or scale.device != pos.device:
        raise ValueError(f"{op}: scale must match pos ({tuple(pos.shape)} on {pos.device}), got "
                         f"{tuple(scale.shape)} on {scale.device}")
    return scale.contiguous()


def _check_valid_rows(op: str, valid_rows: Optional[torch.Tensor], device: torch.device) -> None:
    if valid_rows is not None and (valid_rows.numel() != 1 or valid_rows.dtype.is_floating_point
                                   or valid_rows.device != device):
        raise ValueError(f"{op}: valid_rows must be a one-element integer tensor on {device}, got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)} on {valid_rows.device}")


def _rows_major(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [rows, hidden], got shape {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def expand(
    src: torch.Tensor,
    pos: torch.Tensor,
    rows: int,
    expert_offsets: torch.Tensor,
    counts: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    other: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    scale_rows: Optional[torch.Tensor] = None,
    valid_rows: Optional[torch.Tensor] = None,
    slot: Optional[torch.Tensor] = None,
):
    """out [rows, H] with out[pos[t, j]] = scale[t, j] * src[t] and every padding row zero.

    src [T, H]; pos [T, K]; expert_offsets int32 [E + 1] and counts [E] on the device (see the
    module docstring); scale [T, K] or None (ones). With other [rows, H], returns (out, dot) where
    dot [T, K] fp32 = <src[t], other[pos[t, j]]>. out: a row-major [rows, H] buffer to write into.
    scale_rows: a [rows] buffer (with scale) that also gets scale_rows[pos[t, j]] = scale[t, j] and
    zeros on the padding rows, in the same launch (rows past the last expert's group are left as
    they are). valid_rows: a one-element integer tensor on the device; source rows from its value on
    write nothing (their dot entries are zero). slot: a one-element int32 tensor on the device, out
    then stacked [W, rows, H] and written at out[slot] (a weight-gradient window's slot,
    products/window.py: no copy into it afterwards); returns None then (out[slot] is not a view the
    host can name while the slot is read on the device).
    """
    op = "expand"
    src = _rows_major(op, "src", src)
    T, H = src.shape
    _check_positions(op, pos, T, src.device)
    _check_valid_rows(op, valid_rows, src.device)
    scale = _check_scale(op, scale, pos)
    E = counts.shape[0]
    if expert_offsets.shape != (E + 1,) or expert_offsets.dtype != torch.int32:
        raise ValueError(f"{op}: expert_offsets must be int32 [{E + 1}] (counts has {E} experts), got "
                         f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}")
    if slot is not None:
        if (out is None or out.dim() != 3 or tuple(out.shape[1:]) != (rows, H) or not out.is_contiguous()
                or out.dtype != src.dtype or out.device != src.device or other is not None):
            raise ValueError(f"{op}: with a slot, out must be a contiguous stacked [W, {rows}, {H}] {src.dtype} "
                             f"tensor on {src.device} (and no other)")
        if slot.numel() != 1 or slot.dtype != torch.int32 or slot.device != src.device:
            raise ValueError(f"{op}: slot must be a one-element int32 tensor on {src.device}")
    elif out is None:
        out = torch.empty(rows, H, dtype=src.dtype, device=src.device)
    elif tuple(out.shape) != (rows, H) or out.dtype != src.dtype or out.stride(1) != 1 or out.device != src.device:
        raise ValueError(f"{op}: out must be a row-major [{rows}, {H}] {src.dtype} tensor on {src.device}")
    rows_out = out[0] if slot is not None else out  # one slot's [rows, H]
    if scale_rows is not None and (scale is None or scale_rows.shape != (rows,) or not scale_rows.is_contiguous()
                                   or scale_rows.device != src.device):
        raise ValueError(f"{op}: scale_rows must be a contiguous [{rows}] tensor on {src.device}, given with scale")
    dot = None
    if other is not None:
        other = _rows_major(op, "other", other)
        if tuple(other.shape) != (rows, H):
            raise ValueError(f"{op}: other must be [{rows}, {H}], got {tuple(other.shape)}")
        dot = (torch.zeros if valid_rows is not None else torch.empty)(pos.shape, dtype=torch.float32,
                                                                        device=src.device)
    pos = pos.contiguous()
    K = pos.shape[1]
    if E + T > 0 and H > 0:
        _check_device(src.device)
        k_pow2 = next_power_of_2(max(K, 1))
        block_h = _block_h(H, k_pow2)
        direct(_kernels.expand_kernel)[(E + T,)](
            src, out, pos, scale if scale is not None else src, other if other is not None else out,
            dot if dot is not None else src,
            expert_offsets, counts,
            E, H, src.stride(0), rows_out.stride(0), (other if other is not None else rows_out).stride(0),
            K=K, K_POW2=k_pow2, BLOCK_H=block_h, PAD_ROWS=max(1, _TILE_ELEMENTS // block_h),
            HAS_SCALE=scale is not None, HAS_DOT=other is not None,
            scale_rows_ptr=scale_rows, HAS_SCALE_ROWS=scale_rows is not None,
            valid_ptr=valid_rows, HAS_VALID=valid_rows is not None,
            slot_ptr=slot, slot_stride=rows * H, SLOT=slot is not None,
            num_warps=4,
        )
    else:
        if dot is not None:
            dot.zero_()
        if scale_rows is not None:  # no hidden columns: the row weights still get written
            scale_rows.zero_().index_put_((pos.reshape(-1).long(),), scale.reshape(-1).to(scale_rows.dtype))
    if slot is not None:
        return None
    return out if other is None else (out, dot)


def reduce(src: torch.Tensor, pos: torch.Tensor, scale: Optional[torch.Tensor] = None,
           copy: Optional[torch.Tensor] = None, partials: Optional[torch.Tensor] = None,
           valid_rows: Optional[torch.Tensor] = None):
    """dst [T, H] with dst[t] = sum_j scale[t, j] * src[pos[t, j]] (fp32 sums); src [rows, H].
    With `copy` (like src), also copy[pos[t, j]] = src[pos[t, j]] in the same pass (a source that
    will be overwritten, kept for a backward). With `partials` (contiguous fp32 [rows, C]), returns
    (dst, row_sums) where row_sums [T, K] fp32 = sum_c partials[pos[t, j], c], in the same launch.
    valid_rows: a one-element integer tensor on the device; dst rows from its value on are left
    unwritten (their contents undefined, their row_sums zero), and nothing is read or copied for them."""
    op = "reduce"
    src = _rows_major(op, "src", src)
    H = src.shape[1]
    if pos.dim() != 2:
        raise ValueError(f"{op}: pos must be 2-D [tokens, top_k], got shape {tuple(pos.shape)}")
    T = pos.shape[0]
    _check_positions(op, pos, T, src.device)
    _check_valid_rows(op, valid_rows, src.device)
    scale = _check_scale(op, scale, pos)
    dst = torch.empty(T, H, dtype=src.dtype, device=src.device)
    pos = pos.contiguous()
    K = pos.shape[1]
    row_sums = None
    if partials is not None:
        if (partials.dim() != 2 or partials.shape[0] != src.shape[0] or partials.dtype != torch.float32
                or not partials.is_contiguous() or partials.device != src.device):
            raise ValueError(f"{op}: partials must be a contiguous fp32 [{src.shape[0]}, C] tensor on {src.device}, "
                             f"got {partials.dtype} {tuple(partials.shape)} on {partials.device}")
        row_sums = (torch.zeros if valid_rows is not None else torch.empty)(pos.shape, dtype=torch.float32,
                                                                             device=src.device)
        if T * K > 0 and (H == 0 or partials.shape[1] == 0):  # the kernel sums nothing then
            row_sums.copy_(partials.sum(1)[pos.long()])
    if T > 0 and H > 0:
        if K == 0:
            return dst.zero_() if row_sums is None else (dst.zero_(), row_sums)
        _check_device(src.device)
        if copy is not None and (copy.shape != src.shape or copy.dtype != src.dtype or copy.stride(1) != 1):
            raise ValueError(
                f"{op}: copy must have src's shape {tuple(src.shape)} and dtype {src.dtype}, rows contiguous"
            )
        direct(_kernels.reduce_kernel)[(T,)](
            src, dst, pos, scale if scale is not None else src, copy if copy is not None else src,
            H, src.stride(0), dst.stride(0), copy.stride(0) if copy is not None else 0,
            K=K, BLOCK_H=_block_h(H, 4), HAS_SCALE=scale is not None, HAS_COPY=copy is not None,
            partials_ptr=partials, row_sums_ptr=row_sums, C=partials.shape[1] if partials is not None else 1,
            BLOCK_C=next_power_of_2(max(partials.shape[1], 1)) if partials is not None else 1,
            HAS_ROW_SUMS=partials is not None and partials.shape[1] > 0,
            valid_ptr=valid_rows, HAS_VALID=valid_rows is not None,
            num_warps=4,
        )
    return dst if row_sums is None else (dst, row_sums)


_POSITION_BLOCK = 64  # copies per program of the positions kernels ([64, 64] comparisons each)


def expert_histogram(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E, blocks]: copies of expert e in blocks 0..b of indices.reshape(-1) (cumulative over
    blocks of the positions kernels); the last column is the count per expert. No tokens: [E, 1] zeros."""
    from .kernels import positions as _positions

    flat = indices.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros(num_experts, 1, dtype=torch.int32, device=flat.device)
    _check_device(flat.device)
    blocks = cdiv(n, _POSITION_BLOCK)
    hist = torch.empty(num_experts, blocks, dtype=torch.int32, device=flat.device)
    direct(_positions.block_histogram_kernel)[(blocks,)](
        flat, hist, n, num_experts, BLOCK=_POSITION_BLOCK, BINS=next_power_of_2(num_experts + 1)
    )
    return torch.cumsum(hist, 1, dtype=torch.int32)


def positions_from_histogram(indices: torch.Tensor, cumulative: torch.Tensor, expert_offsets: torch.Tensor):
    """int32 [T, K]: row of each copy in the expert groups starting at expert_offsets [E (+ 1)],
    token order kept within a group; cumulative from `expert_histogram(indices, E)`."""
    from .kernels import positions as _positions

    flat = indices.reshape(-1)
    n = flat.numel()
    pos = torch.empty(n, dtype=torch.int32, device=flat.device)
    if n:
        direct(_positions.block_positions_kernel)[(cumulative.shape[1],)](
            flat, cumulative, expert_offsets.to(torch.int32), pos, n, cumulative.shape[0], BLOCK=_POSITION_BLOCK
        )
    return pos.view(indices.shape)


def padded_positions(indices: torch.Tensor, counts: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """int32 [T, K]: the padded-buffer row of each routed copy (t, j), on the device.

    indices [T, K] (expert of each copy), counts [E] (copies per expert, all of them), expert_offsets
    int32 [E + 1] (padded group starts). Token order is kept inside each group (a stable counting
    sort: kernels/positions.py, three launches, no radix sort).
    """
    if indices.dim() != 2:
        raise ValueError(f"indices must be [tokens, top_k], got shape {tuple(indices.shape)}")
    return positions_from_histogram(indices, expert_histogram(indices, counts.numel()), expert_offsets)


def grouped_positions(counts: torch.Tensor, expert_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [num_rows, 1]: padded-buffer row of each row of a buffer already grouped by expert.

    num_rows is the sum of counts, known on the host (the grouped buffer's length).
    """
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    i = torch.arange(num_rows, device=counts.device)
    expert = torch.searchsorted(ends, i, right=True).clamp(max=max(counts.shape[0] - 1, 0))
    row = expert_offsets.to(torch.int64)[expert] + i - (ends - counts)[expert]
    return row.to(torch.int32).view(num_rows, 1)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: routed copies per expert (every copy), by scatter_add (bincount would sync on CUDA)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


# Regrouping: several dMoE products summed as one: sum_m S_m^T @ B_m over micro-batches m.
#
# A weight gradient of the experts is S^T @ B, reduced over the expert's tokens. Summed over the
# micro-batches of a training step, it is one product over all their tokens: stack every micro-batch's
# rows, regroup them by expert, and run a single S^T @ B whose reduction per expert is as long as all
# micro-batches together. The output (an fp32 main_grad) is then read and written once per step
# instead of once per micro-batch, and each tile's reduction is long enough to hide its epilogue.
#
# Both operands regroup by whole block rows, which stay contiguous: in the dMoE topology the F blocks
# of block row r sit at data[r*F : (r+1)*F], and B's block row r is B[r*bs : (r+1)*bs]. So the
# regrouped matrix has the dMoE topology of the summed (already block-padded) expert counts, and one
# gather kernel copies each operand's rows in use to their place in it (kernels/regroup.py). Everything
# stays on the device: where each row comes from is computed from the expert offsets without reading
# them on the host.


def _check_regroup(topologies: Sequence[Topology]) -> Tuple[int, int, int]:
    if not topologies:
        raise ValueError("no topologies to regroup")
    first = topologies[0]
    bs, cols, F = first.block_size, first.shape[1], first.blocks_per_row
    for t in topologies:
        if t.expert_offsets is None or not t.blocks_per_row:
            raise ValueError("only dMoE topologies (Topology.for_experts) can be regrouped by expert")
        if (t.block_size, t.shape[1], t.blocks_per_row) != (bs, cols, F):
            raise ValueError(
                "the topologies differ in block size, columns or blocks per row: "
                f"{(t.block_size, t.shape[1], t.blocks_per_row)} vs {(bs, cols, F)}"
            )
        if t.expert_offsets.shape != first.expert_offsets.shape:
            raise ValueError("the topologies have different numbers of experts")
    return bs, cols, F


def regroup_by_expert(topologies: Sequence[Topology]) -> Tuple[Topology, torch.Tensor, torch.Tensor]:
    """(topology of the stacked, expert-regrouped matrix, source_tensor, source_row).

    Block row r of the result is block row source_row[r] of micro-batch source_tensor[r]; both are
    int32 [topology.block_rows], and source_tensor is -1 past the rows in use. Within an expert,
    rows keep the micro-batch order.
    """
    bs, cols, F = _check_regroup(topologies)
    device = topologies[0].device
    num_experts = topologies[0].expert_offsets.shape[0] - 1
    max_rows = sum(t.block_rows for t in topologies)

    starts = torch.stack([t.expert_offsets for t in topologies]).to(torch.int64) // bs  # [M, E+1]
    counts = starts[:, 1:] - starts[:, :-1]  # [M, E] block rows of expert e in micro-batch m
    through_m = counts.cumsum(0)  # [M, E] inclusive over micro-batches
    per_expert = through_m[-1]  # [E]
    through_e = per_expert.cumsum(0)  # [E] inclusive over experts

    r = torch.arange(max_rows, device=device, dtype=torch.int64)
    expert = torch.searchsorted(through_e, r, right=True).clamp(max=num_experts - 1)
    position = r - (through_e[expert] - per_expert[expert])  # block row within the expert's group
    m = torch.searchsorted(through_m.t().contiguous()[expert], position.unsqueeze(1), right=True)
    m = m.squeeze(1).clamp(max=len(topologies) - 1)
    row = starts[m, expert] + position - (through_m - counts)[m, expert]
    used = r < through_e[-1]
    source_tensor = torch.where(used, m, -1).to(torch.int32)
    source_row = torch.where(used, row, 0).to(torch.int32)

    block_counts = per_expert * bs  # already whole blocks: the builder adds no padding
    build = _expert_arrays_triton if block_counts.is_cuda else _expert_arrays_torch
    arrays = build(block_counts, F, bs, max_rows)
    topology = Topology(
        shape=(max_rows * bs, cols), block_size=bs, max_blocks=max_rows * F, blocks_per_row=F, **arrays
    )
    return topology, source_tensor, source_row


def gather_block_rows(tensors: Sequence[torch.Tensor], source_tensor: torch.Tensor, source_row: torch.Tensor,
                      block_rows: Sequence[int]) -> torch.Tensor:
    """Block row r of the result = block row source_row[r] of tensors[source_tensor[r]] (tensor m
    has block_rows[m] equal-sized block rows; all share a dtype, a device and the shape past their
    first dim). One Triton launch reads every row in use once and writes it once; rows whose
    source_tensor is negative are left unwritten."""
    width = tensors[0].numel() // block_rows[0]
    device = tensors[0].device
    for t, n in zip(tensors, block_rows):
        if t.numel() != n * width or t.dtype != tensors[0].dtype or t.device != device:
            raise ValueError("the tensors must hold equal block rows of one dtype on one device")
    tensors = [t.contiguous() for t in tensors]  # kept alive until the copy has run
    rows = source_tensor.shape[0]
    out = tensors[0].new_empty(rows * (tensors[0].shape[0] // block_rows[0]), *tensors[0].shape[1:])
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if device.type == "cuda":  # pinned, so that the copy does not wait for the device's queue
        addresses = addresses.pin_memory().to(device, non_blocking=True)
    kernel = _regroup_kernels.gather_rows_kernel
    check_launchable(kernel, device)
    block = min(4096, next_power_of_2(width))
    if rows:
        direct(kernel)[(rows, cdiv(width, block))](out, addresses, source_tensor, source_row, width, BLOCK=block)
    return out


def summed_transposed_products(datas: Sequence[torch.Tensor], topologies: Sequence[Topology],
                               dense: Sequence[torch.Tensor], out: torch.Tensor,
                               accumulate: bool = True) -> torch.Tensor:
    """out += sum_m S_m^T @ B_m for S_m = (datas[m], topologies[m]) and B_m = dense[m], in ONE
    product over the micro-batches' rows regrouped by expert (see the module docstring); out = the
    sum without accumulate (ops.dsd's rules for out)."""
    from ..products.ops import dsd

    if not (len(datas) == len(topologies) == len(dense)):
        raise ValueError("give one data tensor and one B per topology")
    if len(topologies) == 1:
        return dsd(datas[0], topologies[0], dense[0], transpose=True, out=out, accumulate=accumulate)
    for data, topology, b in zip(datas, topologies, dense):
        topology.check_data(data)
        if b.shape[0] != topology.shape[0]:
            raise ValueError(f"B has {b.shape[0]} rows but its topology has {topology.shape[0]}")
    topology, source_tensor, source_row = regroup_by_expert(topologies)
    rows = [t.block_rows for t in topologies]
    data = gather_block_rows(datas, source_tensor, source_row, rows)
    b = gather_block_rows(dense, source_tensor, source_row, rows)
    return dsd(data, topology, b, transpose=True, out=out, accumulate=accumulate)
