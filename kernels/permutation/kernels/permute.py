"""Triton kernels of the dMoE permutation: token order <-> the expert-grouped, block-padded buffer.

Both kernels are token-centric: one program owns one token t and its K routed copies, whose rows in
the padded buffer are pos[t*K + j]. Each token is read (or written) once and the K rows are touched
in one 2-D tile [K_POW2, BLOCK_H], so no atomics are needed and results are deterministic.

  expand_kernel   out[pos(t, j)] = scale(t, j) * src[t]          (permute; un-permute's backward)
                  optionally dot(t, j) = <src[t], other[pos(t, j)]> (the router-weight gradient)
                  optionally scale_rows[pos(t, j)] = scale(t, j), 0 on padding rows (row weights)
                  plus E programs (launched first, so they overlap the token programs) that
                  zero each expert's padding rows
  reduce_kernel   dst[t] = sum_j scale(t, j) * src[pos(t, j)]     (un-permute; permute's backward)
                  optionally copy[pos(t, j)] = src[pos(t, j)] (keeps a transient source)
                  optionally row_sums(t, j) = sum_c partials[pos(t, j), c] (each copy's row of
                  partial sums gathered and summed: the router-weight gradient in the same launch)

Sums and dot products accumulate in fp32. With valid_ptr (HAS_VALID), token programs from
valid_ptr[0] on touch nothing: the received rows of the expert-parallel exchange sit in a buffer of
a bound's size whose real count is known only on the device.
"""
import triton
import triton.language as tl


@triton.jit
def expand_kernel(
    src_ptr, out_ptr, pos_ptr, scale_ptr, other_ptr, dot_ptr,
    expert_offsets_ptr, counts_ptr,
    num_experts, H, stride_src, stride_out, stride_other,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_H: tl.constexpr, PAD_ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, scale_rows_ptr, HAS_SCALE_ROWS: tl.constexpr,
    valid_ptr, HAS_VALID: tl.constexpr,
    slot_ptr=None, slot_stride=0, SLOT: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_H)
    if SLOT:  # out is stacked slots: this launch writes slot slot_ptr[0]
        out_ptr += tl.load(slot_ptr).to(tl.int64) * slot_stride
    if tl.program_id(0) < num_experts:
        # Expert e's group ends in up to bs - 1 padding rows; the weight-gradient products read them.
        e = tl.program_id(0)
        first = tl.load(expert_offsets_ptr + e) + tl.load(counts_ptr + e).to(tl.int32)
        end = tl.load(expert_offsets_ptr + e + 1)
        zeros = tl.zeros((PAD_ROWS, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for r0 in range(first, end, PAD_ROWS):
            r = r0 + tl.arange(0, PAD_ROWS)
            for h0 in range(0, H, BLOCK_H):
                h = h0 + cols
                tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + h[None, :], zeros,
                         mask=(r < end)[:, None] & (h < H)[None, :])
            if HAS_SCALE_ROWS:
                tl.store(scale_rows_ptr + r, tl.zeros((PAD_ROWS,), dtype=scale_rows_ptr.dtype.element_ty),
                         mask=r < end)
    else:
        pid = tl.program_id(0) - num_experts
        # source rows from valid_ptr[0] on (a bound-sized buffer's unused end) move nothing; the
        # masks compare vectors (the interpreter refuses a vector mask anded with a scalar one)
        valid = tl.load(valid_ptr) if HAS_VALID else 0
        slot = tl.arange(0, K_POW2)
        slot_mask = slot < K
        if HAS_VALID:
            slot_mask = slot_mask & (slot * 0 + pid < valid)
        rows = tl.load(pos_ptr + pid * K + slot, mask=slot_mask, other=0).to(tl.int64)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + pid * K + slot, mask=slot_mask, other=0.0)
            if HAS_SCALE_ROWS:
                tl.store(scale_rows_ptr + rows, scale.to(scale_rows_ptr.dtype.element_ty), mask=slot_mask)
            scale = scale.to(tl.float32)
        src_row = src_ptr + pid.to(tl.int64) * stride_src
        # products accumulate element-wise; one reduction after the loop, not one per chunk
        dot = tl.zeros((K_POW2, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + cols
            h_mask = h < H
            if HAS_VALID:
                h_mask = h_mask & (h * 0 + pid < valid)
            x = tl.load(src_row + h, mask=h_mask, other=0.0).to(tl.float32)
            tile = tl.broadcast_to(x[None, :], (K_POW2, BLOCK_H))
            if HAS_SCALE:
                tile = tile * scale[:, None]
            mask2 = slot_mask[:, None] & h_mask[None, :]
            tl.store(out_ptr + rows[:, None] * stride_out + h[None, :],
                     tile.to(out_ptr.dtype.element_ty), mask=mask2)
            if HAS_DOT:
                o = tl.load(other_ptr + rows[:, None] * stride_other + h[None, :], mask=mask2, other=0.0)
                dot += o.to(tl.float32) * x[None, :]
        if HAS_DOT:
            tl.store(dot_ptr + pid * K + slot, tl.sum(dot, axis=1), mask=slot_mask)


@triton.jit
def reduce_kernel(
    src_ptr, dst_ptr, pos_ptr, scale_ptr, copy_ptr,
    H, stride_src, stride_dst, stride_copy,
    K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr,
    partials_ptr, row_sums_ptr, C, BLOCK_C: tl.constexpr, HAS_ROW_SUMS: tl.constexpr,
    valid_ptr, HAS_VALID: tl.constexpr,
):
    # One 1-D row load per copy (unrolled over K): the sum stays inside each thread, where a
    # [K, BLOCK_H] tile summed over K would cross warps through shared memory at every chunk.
    pid = tl.program_id(0)
    # destination rows from valid_ptr[0] on (a bound-sized buffer's unused end) are left unwritten
    valid = tl.load(valid_ptr) if HAS_VALID else 0
    cols = tl.arange(0, BLOCK_H)
    dst_row = dst_ptr + pid.to(tl.int64) * stride_dst
    for h0 in range(0, H, BLOCK_H):
        h = h0 + cols
        h_mask = h < H
        if HAS_VALID:
            h_mask = h_mask & (h * 0 + pid < valid)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(pos_ptr + pid * K + j).to(tl.int64)
            v = tl.load(src_ptr + row * stride_src + h, mask=h_mask, other=0.0)
            if HAS_COPY:
                tl.store(copy_ptr + row * stride_copy + h, v, mask=h_mask)
            v = v.to(tl.float32)
            if HAS_SCALE:
                v = v * tl.load(scale_ptr + pid * K + j).to(tl.float32)
            acc += v
        tl.store(dst_row + h, acc.to(dst_ptr.dtype.element_ty), mask=h_mask)
    if HAS_ROW_SUMS:
        c = tl.arange(0, BLOCK_C)
        for j in tl.static_range(K):
            row = tl.load(pos_ptr + pid * K + j).to(tl.int64)
            c_mask = c < C
            if HAS_VALID:
                c_mask = c_mask & (c * 0 + pid < valid)
            part = tl.load(partials_ptr + row * C + c, mask=c_mask, other=0.0)
            if HAS_VALID:
                tl.store(row_sums_ptr + pid * K + j, tl.sum(part, axis=0), mask=pid < valid)
            else:
                tl.store(row_sums_ptr + pid * K + j, tl.sum(part, axis=0))
