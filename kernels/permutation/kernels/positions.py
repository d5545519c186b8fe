"""Triton kernels that place each routed copy in its expert's group without sorting.

The copy at flat index i (token-major, as indices.reshape(-1)) of expert e goes to row
offsets[e] + (number of earlier copies of e): a stable counting sort in two passes over blocks
of BLOCK copies, with a cumulative sum of the per-block histograms between them.

  block_histogram_kernel   hist[e, b] = copies of expert e in block b
  block_positions_kernel   pos[i] = offsets[e] + (copies of e before block b) + (copies of e
                           before i inside block b), from the inclusive cumulative histogram

The histogram is expert-major so that the cumulative sum runs along its inner dimension: torch's
scan over an outer dimension is many times slower (docs/performance.md, "A scan over the outer
dimension").
"""
import triton
import triton.language as tl


@triton.jit
def block_histogram_kernel(experts_ptr, hist_ptr, n, num_experts, BLOCK: tl.constexpr, BINS: tl.constexpr):
    b = tl.program_id(0)
    blocks = tl.num_programs(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    # lanes past the end count in bin `num_experts`, which is not stored (BINS > num_experts)
    experts = tl.load(experts_ptr + offs, mask=offs < n, other=num_experts).to(tl.int32)
    hist = tl.histogram(experts, BINS)
    bins = tl.arange(0, BINS)
    tl.store(hist_ptr + bins * blocks + b, hist, mask=bins < num_experts)


@triton.jit
def block_positions_kernel(experts_ptr, cumulative_ptr, offsets_ptr, pos_ptr, n, num_experts,
                           BLOCK: tl.constexpr):
    b = tl.program_id(0)
    blocks = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    offs = b * BLOCK + lane
    mask = offs < n
    experts = tl.load(experts_ptr + offs, mask=mask, other=-1).to(tl.int32)  # -1: no real expert
    same = experts[:, None] == experts[None, :]
    earlier_here = tl.sum((same & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
    all_here = tl.sum(same.to(tl.int32), axis=1)
    e = tl.where(mask, experts, 0)
    through_block = tl.load(cumulative_ptr + e * blocks + b, mask=mask, other=0)
    start = tl.load(offsets_ptr + e, mask=mask, other=0)
    tl.store(pos_ptr + offs, start + through_block - all_here + earlier_here, mask=mask)
