"""Softmax top-k routing with the load-balancing loss's column sums, one kernel each way.

  kernels.py    the @triton.jit code
  ops.py        launchers without autograd: route_forward, route_backward, balance_loss(_backward)
  functional.py autograd: fused_route, balance_loss
"""
