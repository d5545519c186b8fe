"""Several dMoE products summed as one: sum_m S_m^T @ B_m over micro-batches m.

A weight gradient of the experts is S^T @ B, reduced over the expert's tokens. Summed over the
micro-batches of a training step, it is one product over all their tokens: stack every micro-batch's
rows, regroup them by expert, and run a single S^T @ B whose reduction per expert is as long as all
micro-batches together. The output (an fp32 main_grad) is then read and written once per step
instead of once per micro-batch, and each tile's reduction is long enough to hide its epilogue.

Both operands regroup by whole block rows, which stay contiguous: in the dMoE topology the F blocks
of block row r sit at data[r*F : (r+1)*F], and B's block row r is B[r*bs : (r+1)*bs]. So the
regrouped matrix has the dMoE topology of the summed (already block-padded) expert counts, and one
gather kernel copies each operand's rows in use to their place in it (regroup_kernel.py). Everything
stays on the device: where each row comes from is computed from the expert offsets without reading
them on the host.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from . import regroup_kernel
from .launch import cdiv, check_launchable, direct, next_power_of_2
from .topology import Topology, _expert_arrays_torch, _expert_arrays_triton


def _check(topologies: Sequence[Topology]) -> Tuple[int, int, int]:
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
    bs, cols, F = _check(topologies)
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
    kernel = regroup_kernel.gather_rows_kernel
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
    from .ops import dsd

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
