"""Block-sparse topology: where the nonzero bs x bs blocks of a [rows x cols] matrix are.

The sparse matrix itself is a tensor ``data`` of shape [max_blocks, bs, bs]; block ``i`` of it sits at
block row ``row_indices[i]`` and block column ``column_indices[i]``. Blocks are stored in row-major
blocked-CSR order: ``offsets[r] : offsets[r + 1]`` are the blocks of block row ``r``.

The transposed view lets the products read the matrix transposed without copying it:
``column_offsets[c] : column_offsets[c + 1]`` index the blocks of block column ``c`` in
``row_indices_t`` (their block rows) and ``block_offsets_t`` (their positions in ``data``).

Only the first ``nnz`` blocks exist. ``nnz`` is a one-element device tensor, so a topology can be
built on the device from routing results without copying anything to the host; every index array is
sized by ``max_blocks``, an upper bound that the caller knows on the host, and the kernels skip the
blocks past ``nnz``. Entries of index arrays past ``nnz`` are zeros; data blocks past ``nnz`` are
undefined and never read. All indices are int32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..launch import cdiv, check_launchable, direct, next_power_of_2

BLOCK_SIZES = (16, 32, 64, 128)


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size} is not supported; use one of {BLOCK_SIZES} "
            "(128 is the default for training, 16 and 32 exist for small tests)"
        )


@dataclass
class Topology:
    """Blocked-CSR metadata of a block-sparse [rows x cols] matrix (see the module docstring).

    Attributes:
      shape: (rows, cols) of the matrix, both multiples of block_size.
      block_size: edge of the square blocks.
      max_blocks: length of the index arrays and the first dimension of the data tensor.
      nnz: int32 tensor [1] on the device, the number of blocks that exist (<= max_blocks).
      row_indices, column_indices: int32 [max_blocks], block coordinates in BCSR order.
      offsets: int32 [block_rows + 1], BCSR row offsets.
      column_offsets: int32 [block_cols + 1], offsets into the column-order arrays.
      row_indices_t: int32 [max_blocks], block rows of the blocks in column order.
      block_offsets_t: int32 [max_blocks], positions in ``data`` of the blocks in column order.
      blocks_per_row: an int F when the topology has the dMoE structure: the nonempty block rows
        come first, each holds the F block columns g*F ... g*F+F-1 of one group g, and g never
        decreases from row to row (so a column's blocks sit in consecutive rows, F positions apart).
        None otherwise. The fast kernels rely on it: no index loads inside their loops, several
        neighbouring blocks per program, L2-friendly program order.
      expert_offsets: for topologies built from expert counts, int32 [num_experts + 1]: the row
        where each expert's group starts in the padded token buffer (last entry: rows used).
        None otherwise.
    """

    shape: tuple
    block_size: int
    max_blocks: int
    nnz: torch.Tensor
    row_indices: torch.Tensor
    column_indices: torch.Tensor
    offsets: torch.Tensor
    column_offsets: torch.Tensor
    row_indices_t: torch.Tensor
    block_offsets_t: torch.Tensor
    blocks_per_row: Optional[int] = None
    expert_offsets: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def block_rows(self) -> int:
        return self.shape[0] // self.block_size

    @property
    def block_cols(self) -> int:
        return self.shape[1] // self.block_size

    def data_shape(self) -> tuple:
        """Shape of the tensor that holds this matrix's blocks."""
        return (self.max_blocks, self.block_size, self.block_size)

    def empty_data(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.data_shape(), dtype=dtype, device=self.device)

    def check_data(self, data: torch.Tensor, name: str = "data") -> None:
        """Raise a clear error when ``data`` cannot hold this topology's blocks."""
        if tuple(data.shape) != self.data_shape():
            raise ValueError(
                f"{name} has shape {tuple(data.shape)} but the topology needs {self.data_shape()} "
                "([max_blocks, block_size, block_size])"
            )
        if data.device != self.device:
            raise ValueError(f"{name} is on {data.device} but the topology is on {self.device}")

    def transposed_shape(self) -> tuple:
        return (self.shape[1], self.shape[0])

    # ------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_mask(
        cls, mask: torch.Tensor, block_size: int, max_blocks: Optional[int] = None
    ) -> "Topology":
        """Topology of the nonzero entries of a boolean block mask [block_rows, block_cols].

        ``max_blocks`` (>= the number of nonzero blocks) pads the index arrays, as a topology built
        on the device would be padded; the default is the exact count. This constructor reads the
        mask on the host: it is for tests and for patterns fixed ahead of time.
        """
        _check_block_size(block_size)
        if mask.dim() != 2:
            raise ValueError(f"mask must be 2-D [block_rows, block_cols], got shape {tuple(mask.shape)}")
        device = mask.device
        mask = mask.to(torch.bool).cpu()
        block_rows, block_cols = mask.shape
        nz = mask.nonzero()  # row-major order: exactly the BCSR order
        count = nz.shape[0]
        if max_blocks is None:
            max_blocks = count
        if max_blocks < count:
            raise ValueError(f"max_blocks={max_blocks} is smaller than the {count} nonzero blocks of the mask")
        rows, cols = nz[:, 0], nz[:, 1]
        offsets = torch.zeros(block_rows + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.bincount(rows, minlength=block_rows), 0)
        column_offsets = torch.zeros(block_cols + 1, dtype=torch.int64)
        column_offsets[1:] = torch.cumsum(torch.bincount(cols, minlength=block_cols), 0)
        order = torch.argsort(cols * block_rows + rows)  # keys are unique: column order, then row

        def padded(values: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(max_blocks, dtype=torch.int32)
            out[:count] = values.to(torch.int32)
            return out.to(device)

        return cls(
            shape=(block_rows * block_size, block_cols * block_size),
            block_size=block_size,
            max_blocks=max_blocks,
            nnz=torch.tensor([count], dtype=torch.int32, device=device),
            row_indices=padded(rows),
            column_indices=padded(cols),
            offsets=offsets.to(torch.int32).to(device),
            column_offsets=column_offsets.to(torch.int32).to(device),
            row_indices_t=padded(rows[order]),
            block_offsets_t=padded(order),
            blocks_per_row=_uniform_row_blocks(mask),
        )

    @classmethod
    def for_experts(
        cls,
        tokens_per_expert: torch.Tensor,
        num_routed: int,
        ffn_hidden_size: int,
        block_size: int = 128,
        check: bool = False,
        builder: str = "auto",
    ) -> "Topology":
        """The dMoE topology, built on the device without any device-to-host copy.

        The matrix is [padded tokens x E * ffn_hidden_size]: expert e's tokens occupy
        ceil(count_e / bs) block rows (its group, padded to whole blocks), and those rows hold
        blocks in the block columns e*F ... (e+1)*F - 1 with F = ffn_hidden_size / bs.

        Args:
          tokens_per_expert: integer tensor [E] on the device.
          num_routed: T * k, the number of routed token copies (the sum of the counts), known on
            the host. It sizes everything: rows = round_up(T*k + E*(bs-1), bs).
          ffn_hidden_size: the width of one expert's hidden layer, a multiple of block_size.
          check: copy the counts to the host and verify that they sum to num_routed (debugging).
          builder: "triton" (two kernel launches), "torch" (plain torch ops, any device) or "auto"
            (triton on CUDA, torch elsewhere). Both give identical arrays.
        """
        _check_block_size(block_size)
        if tokens_per_expert.dim() != 1 or tokens_per_expert.dtype.is_floating_point:
            raise ValueError(
                "tokens_per_expert must be a 1-D integer tensor [num_experts], got "
                f"{tuple(tokens_per_expert.shape)} {tokens_per_expert.dtype}"
            )
        if ffn_hidden_size % block_size != 0:
            raise ValueError(
                f"ffn_hidden_size={ffn_hidden_size} is not a multiple of block_size={block_size}; "
                "pick an expert width divisible by the block size"
            )
        if num_routed < 0:
            raise ValueError(f"num_routed={num_routed} must be >= 0 (tokens times top-k)")
        if check:
            total = int(tokens_per_expert.sum().item())
            if total != num_routed:
                raise ValueError(f"tokens_per_expert sums to {total}, but num_routed={num_routed}")
        if builder not in ("auto", "triton", "torch"):
            raise ValueError(f"builder={builder!r}: use 'auto', 'triton' or 'torch'")
        num_experts = tokens_per_expert.shape[0]
        if num_experts == 0:
            raise ValueError("tokens_per_expert is empty: there must be at least one expert")
        bs = block_size
        F = ffn_hidden_size // bs
        max_rows = max_padded_rows(num_routed, num_experts, bs) // bs
        if builder == "triton" or (builder == "auto" and tokens_per_expert.is_cuda):
            arrays = _expert_arrays_triton(tokens_per_expert, F, bs, max_rows)
        else:
            arrays = _expert_arrays_torch(tokens_per_expert, F, bs, max_rows)
        return cls(
            shape=(max_rows * bs, num_experts * ffn_hidden_size),
            block_size=bs,
            max_blocks=max_rows * F,
            blocks_per_row=F,
            **arrays,
        )



def _expert_arrays_triton(tokens_per_expert: torch.Tensor, F: int, bs: int, max_rows: int) -> dict:
    """Index arrays of the dMoE topology from two Triton launches (see kernels/topology.py)."""
    from .kernels import topology as topology_kernel

    check_launchable(topology_kernel.expert_index_kernel, tokens_per_expert.device)
    device = tokens_per_expert.device
    num_experts = tokens_per_expert.shape[0]
    max_blocks = max_rows * F
    i32 = dict(dtype=torch.int32, device=device)
    row_start = torch.empty(num_experts, **i32)
    row_end = torch.empty(num_experts, **i32)
    out = dict(
        nnz=torch.empty(1, **i32),
        row_indices=torch.empty(max_blocks, **i32),
        column_indices=torch.empty(max_blocks, **i32),
        offsets=torch.empty(max_rows + 1, **i32),
        column_offsets=torch.empty(num_experts * F + 1, **i32),
        row_indices_t=torch.empty(max_blocks, **i32),
        block_offsets_t=torch.empty(max_blocks, **i32),
        expert_offsets=torch.empty(num_experts + 1, **i32),
    )
    e_pow2 = max(16, next_power_of_2(num_experts))
    direct(topology_kernel.expert_prefix_kernel)[(1,)](
        tokens_per_expert, row_start, row_end, out["expert_offsets"], out["nnz"],
        num_experts, F, max_rows, BS=bs, E_POW2=e_pow2,
    )
    block = 256
    span = max(max_blocks, max_rows + 1, num_experts * F + 1)
    direct(topology_kernel.expert_index_kernel)[(cdiv(span, block),)](
        row_start, row_end, out["nnz"],
        out["row_indices"], out["column_indices"], out["offsets"],
        out["column_offsets"], out["row_indices_t"], out["block_offsets_t"],
        num_experts, F, max_rows, max_blocks,
        SEARCH_STEPS=max(1, num_experts.bit_length()) + 1, BLOCK=block,
    )
    return out


def _expert_arrays_torch(tokens_per_expert: torch.Tensor, F: int, bs: int, max_rows: int) -> dict:
    """Index arrays of the dMoE topology from plain torch ops (any device; the tests' second opinion)."""
    device = tokens_per_expert.device
    num_experts = tokens_per_expert.shape[0]
    max_blocks = max_rows * F

    # Block rows per expert, clamped so that a wrong count can never index past the buffers.
    counts = tokens_per_expert.to(torch.int64)
    row_end = torch.clamp(torch.cumsum((counts + bs - 1) // bs, 0), max=max_rows)
    row_start = torch.cat([row_end.new_zeros(1), row_end[:-1]])
    rows_of_expert = row_end - row_start
    used_rows = row_end[-1:] if num_experts > 0 else row_end.new_zeros(1)
    expert_offsets = torch.cat([row_start, used_rows]) * bs

    # BCSR order: block i is in row i // F, the (i % F)-th column of that row's expert.
    i = torch.arange(max_blocks, device=device, dtype=torch.int64)
    row = i // F
    valid = row < used_rows
    expert = torch.searchsorted(row_end, row, right=True).clamp(max=max(num_experts - 1, 0))
    row_indices = torch.where(valid, row, 0)
    column_indices = torch.where(valid, expert * F + i % F, 0)
    r = torch.arange(max_rows + 1, device=device, dtype=torch.int64)
    offsets = torch.minimum(r, used_rows) * F

    # Column order: expert e's F columns each hold that expert's rows_of_expert[e] blocks.
    c = torch.arange(num_experts * F + 1, device=device, dtype=torch.int64)
    c_expert = (c // F).clamp(max=max(num_experts - 1, 0))
    col_start = row_start * F  # where expert e's columns start in column order
    column_offsets = torch.where(
        c < num_experts * F,
        col_start[c_expert] + (c % F) * rows_of_expert[c_expert],
        used_rows * F,
    )
    p = i  # position in column order
    p_expert = torch.searchsorted(col_start, p, right=True) - 1
    p_expert = p_expert.clamp(min=0)
    local = p - col_start[p_expert]
    n_e = rows_of_expert[p_expert].clamp(min=1)
    col_in_expert = local // n_e
    block_row = row_start[p_expert] + local % n_e
    valid_t = p < used_rows * F
    row_indices_t = torch.where(valid_t, block_row, 0)
    block_offsets_t = torch.where(valid_t, block_row * F + col_in_expert, 0)

    as_i32 = lambda t: t.to(torch.int32)  # noqa: E731
    return dict(
        nnz=as_i32(used_rows * F),
        row_indices=as_i32(row_indices),
        column_indices=as_i32(column_indices),
        offsets=as_i32(offsets),
        column_offsets=as_i32(column_offsets),
        row_indices_t=as_i32(row_indices_t),
        block_offsets_t=as_i32(block_offsets_t),
        expert_offsets=as_i32(expert_offsets),
    )


def max_padded_rows(num_routed: int, num_experts: int, block_size: int) -> int:
    """Upper bound of the padded token buffer's rows: T*k + E*(bs-1), rounded up to a block."""
    bound = num_routed + num_experts * (block_size - 1)
    return -(-bound // block_size) * block_size


def padded_expert_offsets(tokens_per_expert: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [E + 1] on the device: row where each expert's padded group starts; last = rows used."""
    counts = tokens_per_expert.to(torch.int64)
    padded = (counts + block_size - 1) // block_size * block_size
    out = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    out[1:] = torch.cumsum(padded, 0)
    return out.to(torch.int32)


def _uniform_row_blocks(mask: torch.Tensor) -> Optional[int]:
    """F when the mask has the dMoE structure (see Topology.blocks_per_row); else None."""
    per_row = mask.sum(1)
    nonempty = int((per_row > 0).sum())
    if nonempty == 0:
        return None
    F = int(per_row[0])
    if not bool((per_row[:nonempty] == F).all()) or bool(per_row[nonempty:].any()):
        return None
    group = -1
    for r in range(nonempty):
        cols = mask[r].nonzero().flatten()
        first = int(cols[0])
        if first % F != 0 or int(cols[-1]) - first != F - 1 or first // F < group:
            return None
        group = first // F
    return F
