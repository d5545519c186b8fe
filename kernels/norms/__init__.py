"""Fused LayerNorm / RMSNorm over rows.

  kernels.py    the @triton.jit code
  functional.py autograd: FusedNormFunction (launches the kernels)
"""
