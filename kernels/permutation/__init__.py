"""The dMoE permutation: token order <-> the expert-grouped, block-padded buffer, and the regrouping
of several micro-batches' rows by expert.

  kernels/      the @triton.jit code: permute (expand, reduce), positions (counting sort by
                expert), regroup (block-row gather)
  ops.py        launchers without autograd: positions, expand, reduce, and the regrouped
                weight-gradient product summed_transposed_products
  functional.py autograd: permute, unpermute
"""
