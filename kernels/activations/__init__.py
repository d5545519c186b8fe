"""GELU / SwiGLU on block-sparse data, over the existing blocks only.

  kernels.py    the @triton.jit code (gelu is also the products' epilogue)
  ops.py        launchers: activation_forward, activation_backward, activation_backward_weighted
"""
