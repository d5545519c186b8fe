"""Triton kernels of the expert activations on block-sparse data (launched by ops.py).

  activation_forward_kernel    gelu(h1) | silu(h1) * h2 over the first nnz blocks
  activation_backward_kernel   their gradients, d_h1 over grad in place
  weighted_backward_kernel     the same for router-weighted rows, plus the rows' <grad, act> sums
  store_to_slots               (both backwards, SLOTS) the activation and the gradients into the
                               weight-gradient windows' slots (products/window.py), the gradients
                               there only unless KEEP
  gelu, gelu_grad              exact (erf) GELU and its derivative in fp32, also used by the
                               products' epilogue (products/kernels/sdd_tma.py)
"""
import triton
import triton.language as tl


@triton.jit
def gelu(x):
    """Exact (erf) GELU of fp32 x; also the forward product's epilogue's (products/kernels/sdd_tma.py)."""
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1 / sqrt(2)


@triton.jit
def gelu_grad(x):
    """d gelu(x) / dx of fp32 x."""
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # 1 / sqrt(2 pi)


@triton.jit
def store_to_slots(offs, mask, act, d1, d2, act_slot_ptr, act_counter_ptr, d1_slot_ptr, d1_counter_ptr,
                   d2_slot_ptr, d2_counter_ptr, slot_elements, SWIGLU: tl.constexpr):
    """The weight gradients' left operands, each into its window's slot `counter` (read here, on the
    device): act for the down-projection's, d1 (and d2) for the up-projection's. Stored here, they
    need no copy into the slots after this pass."""
    act_dst = act_slot_ptr + tl.load(act_counter_ptr).to(tl.int64) * slot_elements
    tl.store(act_dst + offs, act.to(act_slot_ptr.dtype.element_ty), mask=mask)
    d1_dst = d1_slot_ptr + tl.load(d1_counter_ptr).to(tl.int64) * slot_elements
    tl.store(d1_dst + offs, d1.to(d1_slot_ptr.dtype.element_ty), mask=mask)
    if SWIGLU:
        d2_dst = d2_slot_ptr + tl.load(d2_counter_ptr).to(tl.int64) * slot_elements
        tl.store(d2_dst + offs, d2.to(d2_slot_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activation_forward_kernel(h1_ptr, h2_ptr, out_ptr, nnz_ptr, block_elements,
                               SWIGLU: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.load(nnz_ptr).to(tl.int64) * block_elements
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start >= n:
        return
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(h1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        b = tl.load(h2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
    else:
        y = gelu(a)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activation_backward_kernel(grad_ptr, h1_ptr, h2_ptr, d2_ptr, nnz_ptr,
                                act_slot_ptr, act_counter_ptr, d1_slot_ptr, d1_counter_ptr, d2_slot_ptr,
                                d2_counter_ptr, slot_elements, block_elements,
                                SWIGLU: tl.constexpr, SLOTS: tl.constexpr, KEEP: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.load(nnz_ptr).to(tl.int64) * block_elements
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start >= n:
        return
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(h1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        b = tl.load(h2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        d1 = g * b * sig * (1.0 + a * (1.0 - sig))
        d2 = g * a * sig
        act = a * sig * b
    else:
        d1 = g * gelu_grad(a)
        d2 = d1
        act = gelu(a)
    if KEEP:  # else the gradients go to the slots only
        tl.store(grad_ptr + offs, d1.to(grad_ptr.dtype.element_ty), mask=mask)
        if SWIGLU:
            tl.store(d2_ptr + offs, d2.to(d2_ptr.dtype.element_ty), mask=mask)
    if SLOTS:
        store_to_slots(offs, mask, act, d1, d2, act_slot_ptr, act_counter_ptr, d1_slot_ptr, d1_counter_ptr,
                       d2_slot_ptr, d2_counter_ptr, slot_elements, SWIGLU)


@triton.jit
def weighted_backward_kernel(grad_ptr, h1_ptr, h2_ptr, d2_ptr, row_weight_ptr, row_dot_ptr, nnz_ptr,
                              act_slot_ptr, act_counter_ptr, d1_slot_ptr, d1_counter_ptr, d2_slot_ptr,
                              d2_counter_ptr, slot_elements, blocks_per_row,
                              SWIGLU: tl.constexpr, SLOTS: tl.constexpr, KEEP: tl.constexpr, BS: tl.constexpr,
                              ROWS: tl.constexpr):
    # ROWS rows of one [BS, BS] block per program. Block b sits in block row b // F, as the
    # (b % F)-th block of that row (the dMoE topology's regular layout). The activation for the
    # row dots is recomputed from h (rounded to the data's dtype, as the kept one is) rather than
    # read: one pass over the hidden layer fewer.
    chunks: tl.constexpr = BS // ROWS
    b = tl.program_id(0) // chunks
    if b >= tl.load(nnz_ptr):
        return
    r = (tl.program_id(0) % chunks) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BS)
    offs = b.to(tl.int64) * (BS * BS) + r[:, None] * BS + c[None, :]
    row = (b // blocks_per_row).to(tl.int64) * BS + r
    g = tl.load(grad_ptr + offs).to(tl.float32)
    a = tl.load(h1_ptr + offs).to(tl.float32)
    if SWIGLU:
        v = tl.load(h2_ptr + offs).to(tl.float32)
        sig = tl.sigmoid(a)
        act = a * sig * v
    else:
        act = gelu(a)
    act = act.to(grad_ptr.dtype.element_ty).to(tl.float32)
    tl.store(row_dot_ptr + row * blocks_per_row + b % blocks_per_row, tl.sum(g * act, axis=1))
    g = g * tl.load(row_weight_ptr + row)[:, None].to(tl.float32)
    if SWIGLU:
        d1 = g * v * sig * (1.0 + a * (1.0 - sig))
        d2 = g * a * sig
    else:
        d1 = g * gelu_grad(a)
        d2 = d1
    if KEEP:
        tl.store(grad_ptr + offs, d1.to(grad_ptr.dtype.element_ty))
        if SWIGLU:
            tl.store(d2_ptr + offs, d2.to(d2_ptr.dtype.element_ty))
    if SLOTS:
        store_to_slots(offs, offs >= 0, act, d1, d2, act_slot_ptr, act_counter_ptr, d1_slot_ptr, d1_counter_ptr,
                       d2_slot_ptr, d2_counter_ptr, slot_elements, SWIGLU)
