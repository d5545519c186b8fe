"""The MoE layer's execution paths, one object per way of running it, chosen once when the layer is
built (and again only when its weights move to another device or dtype):

- local_sparse: every expert here, block-sparse kernels: tokens go straight into the padded buffer
  and the permutation, experts and weighted combine are one autograd function;
- local_dropless: every expert here, grouped_mm or reference experts on expert-sorted rows;
- expert_parallel: experts spread over the expert-parallel group, rows exchanged both ways;
- capacity: the token-dropping baseline (capacity buffer, batched matmuls).

Each path owns its dispatch, experts call and combine; the layer keeps the router, the aux losses
and the shared experts, which every path uses alike.
"""
from .choose import choose_path

__all__ = ["choose_path"]
