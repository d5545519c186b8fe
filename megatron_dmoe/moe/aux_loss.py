"""Router auxiliary losses and the autograd function that feeds their gradient to the router.

The losses never join the language-model loss as numbers: `AuxLossScaler` is applied to the MoE
layer's output, and its backward hands the aux loss the gradient `loss_scale`. So the gradient is
right under activation recompute, pipeline stages and any number of micro-batches without a
module-global list of losses.
"""
from __future__ import annotations

from typing import Optional

import torch


def _token_count(valid: Optional[torch.Tensor], num_tokens: int, like: torch.Tensor):
    if valid is None:
        return num_tokens
    # a tensor, so that counting the valid tokens needs no host sync; clamped for all-padding batches
    return valid.sum().to(like.dtype).clamp(min=1)


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    top_k: int,
    coeff: float,
    score_function: str = "softmax",
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """coeff * E * sum_i f_i * P_i (Switch Transformer / megatron form).

    f_i = assignments to expert i / (T * k) (no gradient), P_i = mean over tokens of the router
    probability of expert i; sigmoid scores are first normalised to sum 1 per token.
    scores [T, E]; tokens_per_expert [E] counting the valid tokens only; valid [T] bool or None.
    """
    probs = scores if score_function == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    if valid is not None:
        probs = probs * valid.to(probs.dtype)[:, None]
    num_tokens = _token_count(valid, probs.shape[0], probs)
    num_experts = probs.shape[-1]
    fraction_routed = tokens_per_expert.to(probs.dtype) / (num_tokens * top_k)
    mean_prob = probs.sum(dim=0) / num_tokens
    return coeff * num_experts * torch.sum(fraction_routed * mean_prob)


def z_loss(logits: torch.Tensor, coeff: float, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """coeff * mean over tokens of logsumexp(logits)^2 (ST-MoE router z-loss)."""
    per_token = torch.logsumexp(logits, dim=-1).square()
    if valid is None:
        return coeff * per_token.mean()
    per_token = per_token * valid.to(per_token.dtype)
    return coeff * per_token.sum() / _token_count(valid, per_token.shape[0], per_token)


class AuxLossScaler(torch.autograd.Function):
    """forward(output, aux_loss) = output; backward gives aux_loss the gradient `loss_scale`.

    The training loop sets the scale each step with `set_loss_scale`, e.g. 1/num_microbatches
    (times the fp16 loss scale), so aux losses are scaled like the main loss.
    """

    loss_scale = 1.0
    # One 0-dim fp32 tensor per device holding loss_scale, updated in place: a backward captured
    # in a CUDA graph reads the scale from this address on every replay.
    _scale_buffers: dict = {}

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        # a fresh tensor, not a view of the input: the caller may modify it in place
        # (bias-dropout-add does), which autograd forbids on a custom Function's returned input
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = AuxLossScaler._scale_on(aux_loss.device)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype)

    @classmethod
    def _scale_on(cls, device: torch.device) -> torch.Tensor:
        buffer = cls._scale_buffers.get(device)
        if buffer is None:
            buffer = torch.zeros((), dtype=torch.float32, device=device)
            buffer.copy_(torch.as_tensor(cls.loss_scale, dtype=torch.float32).reshape(()))
            cls._scale_buffers[device] = buffer
        return buffer

    @classmethod
    def set_loss_scale(cls, scale) -> None:
        """Gradient the aux losses get per unit of their value: a float or a 0-dim tensor."""
        cls.loss_scale = scale
        for buffer in cls._scale_buffers.values():
            if isinstance(scale, torch.Tensor):
                buffer.copy_(scale.detach().reshape(()), non_blocking=True)
            else:
                buffer.fill_(float(scale))
