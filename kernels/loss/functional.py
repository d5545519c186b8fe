"""Fused language-model cross-entropy: two Triton kernels over the [tokens, vocabulary] logits.

    loss = cross_entropy(logits [N, V] (bf16, fp16 or fp32), labels [N]) -> [N] fp32

Forward reads the logits once: one program per token streams its row in chunks, keeping a running
maximum, the running sum of exponentials and the target's logit (online softmax), and stores the
loss and the log-sum-exp. Backward reads them once more and writes softmax - one_hot(label), times
the loss gradient. With inplace_backward it writes over the logits themselves: the language model
uses that, since nothing else needs its logits after the loss (the output layer's backward keeps its
input and weight) and a second [N, V] buffer would add its size to the step's peak memory; backward
then runs once per forward (no retain_graph through the loss).

megatron-core's native fused cross-entropy (torch.compile'd, vocabulary-parallel) makes about ten
passes over an fp32 copy of the logits; with a 50k vocabulary that was a large share of a GPT Small
training step (docs/performance.md, "Cross-entropy in megatron-core"). This one serves
tensor-parallel size 1 (whole vocabulary rows on one rank); vocabulary-parallel logits keep
megatron's. Labels must lie in [0, V): they are not checked (that would need a device-to-host copy).
"""
from __future__ import annotations

import torch

from ..launch import bind_device, direct
from . import kernels as _kernels

BLOCK_V = 4096  # vocabulary entries per chunk of a row


def _launch_options(device: torch.device) -> dict:
    return {"num_warps": 8} if device.type == "cuda" else {}


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inplace_backward):
        n, vocab = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            direct(_kernels.cross_entropy_forward_kernel)[(n,)](
                logits, labels, loss, lse, vocab, logits.stride(0), BLOCK_V=BLOCK_V, **_launch_options(logits.device)
            )
        ctx.save_for_backward(logits, labels, lse)
        ctx.inplace_backward = inplace_backward
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, labels, lse = ctx.saved_tensors
        n, vocab = logits.shape
        bind_device(logits)  # autograd's worker thread
        grad = logits if ctx.inplace_backward else logits.clone()
        if n:
            direct(_kernels.cross_entropy_backward_kernel)[(n,)](
                grad, labels, lse, dloss.float().contiguous(), vocab, grad.stride(0),
                BLOCK_V=BLOCK_V, **_launch_options(logits.device),
            )
        return grad, None, None


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """Per-token loss [*] (fp32) of logits [*, V] against labels [*]; see the module docstring.
    inplace_backward: backward writes the gradient over the logits' storage (their values are lost)."""
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fused_cross_entropy: logits must be float32, float16 or bfloat16, not {logits.dtype}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"fused_cross_entropy: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         "must agree on every dimension but the last")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"fused_cross_entropy: labels must be integers, not {labels.dtype}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    loss = _FusedCrossEntropy.apply(flat, labels.reshape(-1).contiguous(), inplace_backward)
    return loss.view(labels.shape)
