"""Triton kernels of the softmax top-k router: one kernel forward, one backward.

Each program owns BLOCK_T token rows and all E experts of them as one [BLOCK_T, E_POW2] tile.

  route_forward_kernel    logits [T, E] fp32 -> scores = softmax(logits) [T, E], the top-k of each
                          row: indices [T, K] int64 and weights [T, K] (the probabilities, optionally
                          renormalised to sum 1, times a scale), and this program's column sums of
                          the probabilities over its valid rows: partial [programs, E]
  route_backward_kernel   d_logits [T, E] = softmax backward of
                          d_scores + valid[t] * d_colsum[e] + scatter(d(probabilities at indices))
  balance_loss_kernel     the load-balancing loss scale * <counts, colsum> (and the metrics' running
                          sums); balance_loss_backward_kernel its gradient, scale * counts

The top-k is k rounds of a row maximum over the experts not yet chosen, read from the logits (the
order of the probabilities, without the ties that rounding or underflow makes among them). Among
equal logits the lowest expert index wins; NaN counts as larger than any number (as torch.topk
treats it), so every index is a real expert whatever the input.
"""
import triton
import triton.language as tl


@triton.jit
def route_forward_kernel(
    logits_ptr, scores_ptr, weights_ptr, indices_ptr, partial_ptr, valid_ptr,
    T, E, stride_logits, scale,
    K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_VALID: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # fp64 where torch.compile launches the kernel
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    row_ok = rows < T
    col_ok = cols < E
    tile_ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_logits + cols[None, :], mask=tile_ok, other=float("-inf"))
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past T (never stored): finite, no NaN to compute
    # numerically stable softmax; padding columns are -inf and get probability 0
    m = tl.max(x, axis=1)
    p = tl.exp(x - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    tl.store(scores_ptr + rows[:, None] * E + cols[None, :], p, mask=tile_ok)

    # column sums of the probabilities over this program's valid rows (reduced on the host side)
    keep = row_ok
    if HAS_VALID:
        keep = keep & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
    colsum = tl.sum(tl.where(keep[:, None] & col_ok[None, :], p, 0.0), axis=0)
    tl.store(partial_ptr + pid.to(tl.int64) * E + cols, colsum, mask=col_ok)

    # top-k: NaN logits rank above everything; padding columns never win (k <= E leaves a real one).
    # Choices collect in [BLOCK_T, K_POW2] register tiles, stored once at the end.
    sel = tl.where(x != x, float("inf"), x)
    avail = tl.broadcast_to(col_ok[None, :], (BLOCK_T, E_POW2))
    slots = tl.arange(0, K_POW2)
    top_idx = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    top_w = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    for j in range(K):
        best = tl.max(tl.where(avail, sel, float("-inf")), axis=1)
        hit = avail & (sel == best[:, None])
        idx = tl.min(tl.where(hit, cols[None, :], E_POW2), axis=1)
        chosen = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(chosen, p, 0.0), axis=1)  # the stored probability, bit for bit
        avail = avail & ~chosen
        top_idx = tl.where(slots[None, :] == j, idx[:, None], top_idx)
        top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
    if RENORMALIZE:  # as torch's route: w / (sum + 1e-20); the epsilon only matters for sigmoid there
        top_w = top_w / (tl.sum(top_w, axis=1) + 1e-20)[:, None]
    if HAS_SCALE:
        top_w = top_w * scale
    k_ok = row_ok[:, None] & (slots < K)[None, :]
    k_offs = rows[:, None] * K + slots[None, :]
    tl.store(indices_ptr + k_offs, top_idx.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + k_offs, top_w, mask=k_ok)


@triton.jit
def route_backward_kernel(
    scores_ptr, indices_ptr, d_weights_ptr, d_colsum_ptr, d_scores_ptr, valid_ptr, d_logits_ptr,
    T, E, scale,
    K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr, HAS_DW: tl.constexpr, HAS_DCOLSUM: tl.constexpr, HAS_DSCORES: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # fp64 where torch.compile launches the kernel
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    row_ok = rows < T
    col_ok = cols < E
    tile_ok = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * E + cols[None, :]
    p = tl.load(scores_ptr + offs, mask=tile_ok, other=0.0)

    # g: the gradient of the loss w.r.t. the probabilities
    g = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    if HAS_DSCORES:
        g += tl.load(d_scores_ptr + offs, mask=tile_ok, other=0.0)
    if HAS_DCOLSUM:
        dc = tl.load(d_colsum_ptr + cols, mask=col_ok, other=0.0)
        if HAS_VALID:
            v = tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0
            g += tl.where(v[:, None], dc[None, :], 0.0)
        else:
            g += dc[None, :]
    if HAS_DW:
        # the k choices as [BLOCK_T, K_POW2] tiles; column j is pulled out in registers below
        slots = tl.arange(0, K_POW2)
        k_ok = row_ok[:, None] & (slots < K)[None, :]
        k_offs = rows[:, None] * K + slots[None, :]
        top_idx = tl.load(indices_ptr + k_offs, mask=k_ok, other=-1).to(tl.int32)
        top_dw = tl.load(d_weights_ptr + k_offs, mask=k_ok, other=0.0)
        if RENORMALIZE:
            # w_j = scale * p_j / D with D = sum_i p_i + 1e-20:
            # dL/dp_j = scale / D * (dw_j - sum_i dw_i p_i / D)
            total = tl.zeros((BLOCK_T,), dtype=tl.float32)
            dot = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for j in range(K):
                idx = tl.sum(tl.where(slots[None, :] == j, top_idx, 0), axis=1)
                dw = tl.sum(tl.where(slots[None, :] == j, top_dw, 0.0), axis=1)
                pj = tl.sum(tl.where(cols[None, :] == idx[:, None], p, 0.0), axis=1)
                total += pj
                dot += dw * pj
            denom = total + 1e-20
            shift = dot / denom
            factor = scale / denom
        else:
            shift = tl.zeros((BLOCK_T,), dtype=tl.float32)
            factor = tl.zeros((BLOCK_T,), dtype=tl.float32) + scale
        for j in range(K):
            idx = tl.sum(tl.where(slots[None, :] == j, top_idx, 0), axis=1)
            dw = tl.sum(tl.where(slots[None, :] == j, top_dw, 0.0), axis=1)
            dp = factor * (dw - shift)
            g += tl.where(cols[None, :] == idx[:, None], dp[:, None], 0.0)

    # softmax backward
    inner = tl.sum(p * g, axis=1)
    d = p * (g - inner[:, None])
    tl.store(d_logits_ptr + offs, d, mask=tile_ok)


@triton.jit
def balance_loss_kernel(
    colsum_ptr, counts_ptr, loss_ptr, scale,
    lb_sum_ptr, lb_count_ptr, load_ptr,  # running sums (RECORD only)
    E,
    BLOCK_E: tl.constexpr, RECORD: tl.constexpr,
):
    """loss = scale * <counts, colsum>; with RECORD also lb_sum += loss, lb_count += 1, load += counts."""
    scale = tl.cast(scale, tl.float32)  # fp64 where torch.compile launches the kernel
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    counts = tl.load(counts_ptr + e, mask=ok, other=0)
    colsum = tl.load(colsum_ptr + e, mask=ok, other=0.0)
    loss = tl.sum(counts.to(tl.float32) * colsum, axis=0) * scale
    tl.store(loss_ptr, loss)
    if RECORD:
        tl.store(lb_sum_ptr, tl.load(lb_sum_ptr) + loss.to(tl.float64))
        tl.store(lb_count_ptr, tl.load(lb_count_ptr) + 1.0)
        tl.store(load_ptr + e, tl.load(load_ptr + e, mask=ok) + counts.to(load_ptr.dtype.element_ty), mask=ok)


@triton.jit
def balance_loss_backward_kernel(d_loss_ptr, counts_ptr, d_colsum_ptr, scale, E, BLOCK_E: tl.constexpr):
    """d_colsum = d_loss * scale * counts."""
    scale = tl.cast(scale, tl.float32)  # fp64 where torch.compile launches the kernel
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    counts = tl.load(counts_ptr + e, mask=ok, other=0)
    tl.store(d_colsum_ptr + e, tl.load(d_loss_ptr) * scale * counts.to(tl.float32), mask=ok)
