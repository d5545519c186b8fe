"""Fused language-model cross-entropy over whole vocabulary rows.

  kernels.py    the @triton.jit code
  functional.py autograd: fused_cross_entropy (launches the kernels); reference.cross_entropy is
                the pure-torch version
"""
