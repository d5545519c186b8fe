"""The permutation's @triton.jit code, one module per kernel family (launched by ../ops.py)."""
