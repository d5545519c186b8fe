"""The products' @triton.jit code, one module per kernel (launched by ../ops.py and ../topology.py)."""
