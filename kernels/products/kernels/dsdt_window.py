"""A window's weight gradient: sum over W micro-batches of S_w^T @ B_w, added into fp32 C once.

Each micro-batch's operands wait in slot w of stacked buffers (products/window.py copies them
there): S_w's blocks in slot w of `s_desc` (rows w * slot_s_rows ...), B_w's rows in slot w of
`b_desc`, and its dMoE topology as padded expert offsets offsets[w, 0 .. E]. For the dMoE
topology these offsets say everything dsdt_tma_kernel reads from the index arrays: output tile tm
is ffn block j = tm % F of expert e = tm // F, whose group starts at block row r0 = offsets[w, e] / BS
and has nblk = (offsets[w, e + 1] - offsets[w, e]) / BS block rows; its blocks are r0 * F + j,
(r0 + 1) * F + j, ... in the data and its rows of B start at r0 * BS.

The loops are dsdt_tma_kernel's, fused by hand over segments: a segment is one (tile, slot), every
tile has W of them, an empty one takes one step that reads out of bounds (TMA returns zeros), and a
tile is added to C (C += acc, read and written once) at its last segment's last step. So C's
traffic is paid once per window instead of once per micro-batch.

counter_ptr gates the launch: the product runs only when the window is full (counter == W - 1);
otherwise every program returns at once. A captured backward can then launch it at every
micro-batch.

Tiles go to programs longest first: a tile's steps are its expert's blocks over the window, so
under skewed loads round-robin tiles leave some programs with far more steps than others. The
experts' order by steps (`order_ptr`, most first; stashed by copy_to_slot_kernel as the window
fills) lists the tiles, expert after expert, and the programs take them in snake order (round k:
program p takes tile k * P + p for even k, k * P + P - 1 - p for odd k), which evens the programs'
totals. Each tile is still summed by one program in the same order, so C is the same bit for bit.

TMA_REDUCE: a finished tile is added to C by the tensor-memory accelerator's reduce (c_desc, fp32
blocks [BS, STRIP]: C += tile in L2, issued without waiting) instead of loading C's tile through
pointers, adding and storing it, which stalls the program until C's old values arrive. Each tile
of C is added once per window by one program, so the sums are the same either way. The Triton
interpreter has no TMA reduce: on CPU only the pointer epilogue runs.
"""
import triton
import triton.language as tl

from .dsd_tma import add_tile_to_output, halves
from .tile_mapping import grouped_tile


@triton.jit
def _reduce_tile(c_desc, row0, col0, acc, BS: tl.constexpr, BLOCK_N: tl.constexpr, STRIP: tl.constexpr):
    """C[row0 :, col0 :] += acc ([BS, BLOCK_N] fp32) in strips of STRIP columns by TMA reduce;
    columns past C's edge are dropped by the descriptor."""
    if BLOCK_N == STRIP:
        c_desc.atomic_add([row0, col0], acc)
    elif BLOCK_N == 2 * STRIP:
        left, right = halves(acc, BS, BLOCK_N)
        c_desc.atomic_add([row0, col0], left)
        c_desc.atomic_add([row0, col0 + STRIP], right)
    else:  # 4 strips
        left, right = halves(acc, BS, BLOCK_N)
        l0, l1 = halves(left, BS, BLOCK_N // 2)
        r0, r1 = halves(right, BS, BLOCK_N // 2)
        c_desc.atomic_add([row0, col0], l0)
        c_desc.atomic_add([row0, col0 + STRIP], l1)
        c_desc.atomic_add([row0, col0 + 2 * STRIP], r0)
        c_desc.atomic_add([row0, col0 + 3 * STRIP], r1)


@triton.jit
def _snake_tile(k, pid, num_programs):
    """The tile a program takes in round k (a scalar or a tensor of rounds): forward in even
    rounds, backward in odd ones."""
    return k * num_programs + tl.where(k % 2 == 0, pid, num_programs - 1 - pid)


@triton.jit
def _window_steps(new_ptr, offsets_ptr, e, num_experts, W: tl.constexpr, BS: tl.constexpr, KSTEPS: tl.constexpr):
    """The product's steps for experts e over a window whose last slot's offsets are at new_ptr and
    the others in slots 0 .. W - 2 of offsets_ptr; -1 for e past the experts."""
    valid = e < num_experts
    steps = tl.zeros(e.shape, tl.int32)
    for w in tl.static_range(W):
        src = new_ptr if w == W - 1 else offsets_ptr + w * (num_experts + 1)
        lo = tl.load(src + e, mask=valid, other=0)
        hi = tl.load(src + e + 1, mask=valid, other=0)
        steps += tl.maximum((hi - lo) // BS * KSTEPS, 1)
    return tl.where(valid, steps, -1)


@triton.jit
def _stash_offsets(new_ptr, offsets_ptr, slot, order_ptr, num_experts,
                   W: tl.constexpr, BS: tl.constexpr, KSTEPS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Slot `slot` of offsets_ptr [W, E + 1] = new_ptr's E + 1 padded expert offsets; when they
    complete the window (slot == W - 1), order_ptr [E] = the experts by their steps over the
    window, most first, ties by expert number (the product's tile order)."""
    stride = num_experts + 1
    for base in range(0, stride, BLOCK_E):
        i = base + tl.arange(0, BLOCK_E)
        tl.store(offsets_ptr + slot * stride + i, tl.load(new_ptr + i, mask=i < stride), mask=i < stride)
    if slot == W - 1:
        for base in range(0, num_experts, BLOCK_E):
            e = base + tl.arange(0, BLOCK_E)
            mine = _window_steps(new_ptr, offsets_ptr, e, num_experts, W, BS, KSTEPS)
            rank = tl.zeros([BLOCK_E], tl.int32)
            for other_base in range(0, num_experts, BLOCK_E):
                other = other_base + tl.arange(0, BLOCK_E)
                theirs = _window_steps(new_ptr, offsets_ptr, other, num_experts, W, BS, KSTEPS)
                ahead = (theirs[None, :] > mine[:, None]) | ((theirs[None, :] == mine[:, None])
                                                             & (other[None, :] < e[:, None]))
                rank += tl.sum(ahead.to(tl.int32), axis=1)
            tl.store(order_ptr + rank, e, mask=e < num_experts)


@triton.jit(do_not_specialize=["N", "num_experts", "num_programs", "slot_s_rows", "slot_b_rows",
                               "s_rows", "b_rows"])
def dsdt_window_kernel(
    s_desc, b_desc, offsets_ptr, order_ptr, counter_ptr, c_ptr, stride_cm,
    N, num_experts, num_programs, slot_s_rows, slot_b_rows, s_rows, b_rows,
    F: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT_CHUNK: tl.constexpr,
    c_desc=None, TMA_REDUCE: tl.constexpr = False, STRIP: tl.constexpr = 64,
):
    pid = tl.program_id(0)
    if tl.load(counter_ptr) != W - 1:
        return
    KSTEPS: tl.constexpr = BS // BLOCK_K
    num_n = tl.cdiv(N, BLOCK_N)
    tiles_per_expert = F * num_n
    num_tiles = num_experts * tiles_per_expert
    rounds = tl.cdiv(num_tiles, num_programs)
    stride_w = num_experts + 1

    # Pass 1: total steps of this program (each segment at least one).
    total = 0
    for base in range(0, rounds, COUNT_CHUNK):
        k = base + tl.arange(0, COUNT_CHUNK)
        t = _snake_tile(k, pid, num_programs)
        valid = (k < rounds) & (t < num_tiles)
        e = tl.load(order_ptr + t // tiles_per_expert, mask=valid, other=0)
        for w in tl.static_range(W):
            lo = tl.load(offsets_ptr + w * stride_w + e, mask=valid, other=0)
            hi = tl.load(offsets_ptr + w * stride_w + e + 1, mask=valid, other=0)
            total += tl.sum(tl.where(valid, tl.maximum((hi - lo) // BS * KSTEPS, 1), 0))

    # Pass 2: one loop over every step of every segment of this program (its last round's tile,
    # past the end for some programs, is never reached: pass 1 did not count it).
    k = -1
    w = W - 1
    ki = -1
    steps = 0
    live_steps = 0
    tm = 0
    tn = 0
    first = 0
    blk0 = 0
    acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
    for _ in range(total):
        ki = tl.where(ki == steps - 1, 0, ki + 1)
        if ki == 0:
            w = tl.where(w == W - 1, 0, w + 1)
            k = tl.where(w == 0, k + 1, k)
            t = _snake_tile(k, pid, num_programs)
            e = tl.load(order_ptr + t // tiles_per_expert)
            j, tn = grouped_tile(t % tiles_per_expert, F, num_n, GROUP_M)
            tm = e * F + j
            lo = tl.load(offsets_ptr + w * stride_w + e) // BS
            hi = tl.load(offsets_ptr + w * stride_w + e + 1) // BS
            first = w * slot_b_rows + lo * BS
            blk0 = w * slot_s_rows + (lo * F + j) * BS
            live_steps = (hi - lo) * KSTEPS
            steps = tl.maximum(live_steps, 1)
        live = ki < live_steps
        s_row = tl.where(live, blk0 + (ki // KSTEPS) * F * BS + (ki % KSTEPS) * BLOCK_K, s_rows)
        b_row = tl.where(live, first + ki * BLOCK_K, b_rows)
        s = s_desc.load([s_row, 0]).T
        b = b_desc.load([b_row, tn * BLOCK_N])
        acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)
        if (ki == steps - 1) & (w == W - 1):
            if TMA_REDUCE:
                _reduce_tile(c_desc, tm * BS, tn * BLOCK_N, acc, BS, BLOCK_N, STRIP)
            else:
                add_tile_to_output(c_ptr, stride_cm, N, tm * BS, tn * BLOCK_N, acc, BS, BLOCK_N, True)
            acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)


@triton.jit(do_not_specialize=["n_static", "num_programs", "num_experts"])
def copy_to_slot_kernel(src_ptr, dst_ptr, slot_ptr, count_ptr, n_static, slot_elems, num_programs,
                        COUNT_SCALE: tl.constexpr, HAS_COUNT: tl.constexpr, BLOCK: tl.constexpr,
                        new_offsets_ptr=None, offsets_ptr=None, order_ptr=None, next_counter_ptr=None, num_experts=0,
                        OFFSETS: tl.constexpr = False, ADVANCE: tl.constexpr = False, W: tl.constexpr = 1,
                        BS: tl.constexpr = 1, KSTEPS: tl.constexpr = 1, BLOCK_E: tl.constexpr = 64):
    """dst[slot] [0, n) = src[0, n), slot read on the device; n = count * COUNT_SCALE elements (the
    count read on the device: only the used part of a bound-sized buffer moves) or n_static.
    slot_elems is specialised (its divisibility by 16 known) and every chunk starts at a multiple of
    BLOCK, so that the copies move whole 16-byte vectors.

    OFFSETS: program 0 also stashes the micro-batch's expert offsets into the same slot (and the
    experts' order when the window fills: _stash_offsets), one launch for both. ADVANCE: it also
    sets next_counter = (slot + 1) % W, slot_ptr then being another tensor that holds the slot
    (the launches of this micro-batch read it there, the next micro-batch's producers the counter)."""
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr)
    if OFFSETS:
        if pid == 0:
            if ADVANCE:
                tl.store(next_counter_ptr, (slot + 1) % W)
            _stash_offsets(new_offsets_ptr, offsets_ptr, slot, order_ptr, num_experts, W, BS, KSTEPS, BLOCK_E)
    if HAS_COUNT:
        n = tl.load(count_ptr).to(tl.int64) * COUNT_SCALE
    else:
        n = n_static.to(tl.int64)
    dst = dst_ptr + slot.to(tl.int64) * slot_elems
    offs = tl.arange(0, BLOCK)
    for chunk in range(pid, tl.cdiv(n, BLOCK), num_programs):
        idx = tl.multiple_of(chunk * BLOCK, BLOCK) + offs  # int32: WindowSlots keeps a slot below 2**31 elements
        mask = idx < n
        tl.store(dst + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)
