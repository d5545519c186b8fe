"""Triton kernels of the fused language-model cross-entropy (launched by functional.py).

  cross_entropy_forward_kernel    one program per token: the row streamed in BLOCK_V chunks with
                                  an online softmax; stores the loss and the log-sum-exp
  cross_entropy_backward_kernel   softmax - one_hot(label), times the loss gradient, written over
                                  the given logits buffer
"""
import triton
import triton.language as tl


@triton.jit
def cross_entropy_forward_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64)
    running_max = -float("inf")
    running_sum = 0.0
    target = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
        target += tl.sum(tl.where(offs == label, x, 0.0), 0)
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - target)


@triton.jit
def cross_entropy_backward_kernel(logits_ptr, labels_ptr, lse_ptr, dloss_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g = tl.load(dloss_ptr + row)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)) * g
        tl.store(base + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)
