"""Rows stored straight into other GPUs' symmetric memory (the expert-parallel exchange's kernels).

  kernels.py    the @triton.jit code
  ops.py        launchers: exchange_plan, post_counts, push_rows, push_copies (and ExchangePlan)
"""
