"""Triton kernels of block-scaled fp8 (launched by ops.py; the recipe is in reference.py).

  round_to_e4m3          fp32 -> the nearest e4m3 value (ties to even), still in fp32
  round_to_bf16          fp32 -> the nearest bf16 value (ties to even), still in fp32
  quantize_rows_kernel   1 x 128 tiles of a strided [M, K] matrix (a transpose needs no copy)
  quantize_blocks_kernel 128 x 128 blocks
  matmul_kernel          a [M, K] (row scales) @ b [K, N] (block or column scales) -> c, fp32
                         accumulation, each 128 of K promoted with its scales
  matmul_tma_kernel      the same product with its operands read by TMA descriptors (a row-major,
                         b row-major or K-major) and its K loop software-pipelined: the fast path
                         on Hopper (the pointer kernel's loop is not pipelined there)
"""
import triton
import triton.language as tl

from ..products.kernels.tile_mapping import grouped_tile

E4M3_MAX = tl.constexpr(448.0)  # as reference.E4M3_MAX
AMAX_FLOOR = tl.constexpr(7.888609052210118e-31)  # 2^-100, as reference.AMAX_FLOOR
# Adding and subtracting 1.5 * 2^23 rounds an fp32 |t| < 2^22 to an integer, ties to even.
ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest-even on e4m3's grid: spacing 2^(e-3) for 2^e <= |v|,
    e >= -6, and the subnormals' 2^-9 below 2^-6. The rounding is done here rather than by the
    conversion to float8e4nv, which is then exact: Triton's interpreter (CPU) rounds that conversion
    wrongly (no carry into the exponent, ties away from zero), and this way the kernels tested there
    compute what they compute on the GPU."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    inv_spacing = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    spacing = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    t = v * inv_spacing
    return ((t + ROUNDER) - ROUNDER) * spacing


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to nearest-even bf16, still in fp32 (the conversion after it is then exact):
    the interpreter truncates fp32 -> bf16, where the GPU rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale(amax):
    # div_rn: correctly rounded, as torch divides (Triton's `/` may approximate on the GPU)
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), E4M3_MAX)


@triton.jit
def _to_fp8(x, scale):
    """x / scale (x and scale broadcast alike) clamped to e4m3's range and rounded into it."""
    v = tl.math.div_rn(x, scale)
    v = tl.minimum(tl.maximum(v, -E4M3_MAX), E4M3_MAX)
    return round_to_e4m3(v).to(tl.float8e4nv)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_sk,
                         BLOCK_M: tl.constexpr, TILE: tl.constexpr):
    """Program (i, j): rows i*BLOCK_M.. of tile j (columns j*TILE..), one scale per row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=1))
    q = _to_fp8(x, scale[:, None])
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * stride_sm + tl.program_id(1) * stride_sk, scale, mask=rows < M)


@triton.jit
def quantize_blocks_kernel(w_ptr, q_ptr, s_ptr, R, C, stride_wr, stride_wc, stride_qr, stride_sr,
                           TILE: tl.constexpr):
    """Program (i, j): the block of rows i*TILE.. and columns j*TILE.., one scale."""
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    w = tl.load(w_ptr + rows64[:, None] * stride_wr + cols[None, :] * stride_wc, mask=mask, other=0.0)
    w = w.to(tl.float32)
    scale = _scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :], _to_fp8(w, scale), mask=mask)
    tl.store(s_ptr + tl.program_id(0) * stride_sr + tl.program_id(1), scale)


@triton.jit
def matmul_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_asm, stride_ask, stride_bk, stride_bn, stride_bsk, stride_bsn,
                  stride_cm, stride_cn, B_GROUP_N: tl.constexpr, OUT_BF16: tl.constexpr,
                  IMPRECISE_ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TILE: tl.constexpr):
    """c[BLOCK_M, BLOCK_N] tile of a @ b. Each step of K is one scale tile (TILE = 128): its fp8
    product is multiplied by a's row scales and b's scales (column n's is at n // B_GROUP_N: 128
    for block scales, 1 for column scales) and added to the fp32 accumulator: DeepSeek-V3's
    promotion every 128 of K. Within the step, Hopper's fp8 tensor cores accumulate with reduced
    precision for up to IMPRECISE_ACC products of K before Triton adds them up in fp32 (TILE:
    DeepSeek-V3's scheme; 0: after every instruction). The interpreter sums in fp32 throughout."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, TILE)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, TILE)):
        k = kb * TILE + ks
        a = tl.load(a_ptr + rows64[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols64[None, :] * stride_bn,
                    mask=(k < K)[:, None] & col_ok[None, :], other=0.0)
        sa = tl.load(as_ptr + rows64 * stride_asm + kb * stride_ask, mask=row_ok, other=0.0)
        sb = tl.load(bs_ptr + kb * stride_bsk + (cols64 // B_GROUP_N) * stride_bsn, mask=col_ok, other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_ACC)
        acc += part * (sa[:, None] * sb[None, :])
    if OUT_BF16:
        acc = round_to_bf16(acc)
    tl.store(c_ptr + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def matmul_tma_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
                      stride_asm, stride_ask, stride_bsk, stride_bsn,
                      B_KMAJOR: tl.constexpr, B_GROUP_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      OUT_BF16: tl.constexpr, IMPRECISE_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILE: tl.constexpr, GROUP_M: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    """matmul_kernel's tile of c, its operands loaded through TMA (zero-filled past the edges, so
    ragged M, N and K need no masks there) in a NUM_STAGES-deep pipeline. B_KMAJOR: b_desc
    describes b^T (a row-major [N, K] weight, b given as its transpose), else b itself. Programs
    walk GROUP_M rows of tiles per column for L2 reuse."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(K, TILE), num_stages=NUM_STAGES):
        a = a_desc.load([pid_m * BLOCK_M, kb * TILE])
        if B_KMAJOR:
            b = b_desc.load([pid_n * BLOCK_N, kb * TILE]).T
        else:
            b = b_desc.load([kb * TILE, pid_n * BLOCK_N])
        sa = tl.load(as_ptr + rows64 * stride_asm + kb * stride_ask, mask=row_ok, other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_ACC)
        if B_GROUP_N % BLOCK_N == 0:  # the tile's columns share one scale of b: a vector, not a tile, of scales
            sb = tl.load(bs_ptr + kb * stride_bsk + ((pid_n * BLOCK_N) // B_GROUP_N) * stride_bsn)
            acc += part * (sa * sb)[:, None]
        else:
            sb = tl.load(bs_ptr + kb * stride_bsk + (cols64 // B_GROUP_N) * stride_bsn, mask=col_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
    if OUT_BF16:
        acc = round_to_bf16(acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(OUT_DTYPE))
