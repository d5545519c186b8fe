"""Router auxiliary losses and the autograd function that feeds their gradient to the router.

The losses never join the language-model loss as numbers: `AuxLossScaler` (megatron-core's
MoEAuxLossAutoScaler) is applied to the MoE layer's output, and its backward hands the aux loss the
gradient megatron-core's schedule (or our loop, the same way) set for the micro-batch. So the
gradient is right under activation recompute, pipeline stages and any number of micro-batches
without a module-global list of losses.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_dmoe.compat.aux_loss_scale import scale_on, set_scale


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
    column_sum: Optional[torch.Tensor] = None,
    record=None,
) -> torch.Tensor:
    """coeff * E * sum_i f_i * P_i (Switch Transformer / megatron form).

    f_i = assignments to expert i / (T * k) (no gradient), P_i = mean over tokens of the router
    probability of expert i; sigmoid scores are first normalised to sum 1 per token.
    scores [T, E]; tokens_per_expert [E] counting the valid tokens only; valid [T] bool or None.
    column_sum [E]: sum_t P_t,i over the valid tokens when the router already formed it (the fused
    router does, in its own launch); scores then give only T and E. An fp32 column sum without a
    padding mask goes through dmoe_kernels.balance_loss (one launch each way), whose forward can
    also add the loss and the loads to running sums: record=(lb_sum, lb_count, load), that path only.
    """
    if column_sum is not None and valid is None and column_sum.dtype == torch.float32:
        from dmoe_kernels import balance_loss

        T, E = scores.shape
        return balance_loss(column_sum, tokens_per_expert, coeff * E / (top_k * T * T), record)
    if record is not None:
        raise ValueError("load_balancing_loss: record= needs an fp32 column_sum and no padding mask")
    if column_sum is None:
        probs = scores if score_function == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        if valid is not None:
            probs = probs * valid.to(probs.dtype)[:, None]
        column_sum = probs.sum(dim=0)
    num_tokens = _token_count(valid, scores.shape[0], column_sum)
    # sum_i f_i P_i = <counts, column sums of probs> / (T^2 k): one dot product, the constant folded
    # on the host (fewer launches than forming f and P; the same value up to summation order)
    dot = torch.dot(tokens_per_expert.to(column_sum.dtype), column_sum)
    scale = coeff * scores.shape[-1] / top_k
    if isinstance(num_tokens, int):
        return dot * (scale / (num_tokens * num_tokens))
    return dot * scale / (num_tokens * num_tokens)


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    indices: torch.Tensor,
    num_sequences: int,
    top_k: int,
    coeff: float,
    score_function: str = "softmax",
    valid: Optional[torch.Tensor] = None,
    shards=None,
) -> torch.Tensor:
    """`load_balancing_loss` of each sequence on its own, averaged over the sequences (DeepSeek-V3's
    sequence-wise balance loss; megatron-core's seq_aux_loss).

    shards (parallel/sequence_shards.py), under sequence parallelism: the tokens here are one shard
    of each sequence; the counts are summed over the shards and this shard's share of the loss is
    returned (the shares add up to the loss of whole sequences).

    Tokens are in the layer's [s, b] order flattened (token t = position * b + sequence): scores
    [T, E], indices [T, k] the chosen experts, valid [T] bool or None (padding counts nowhere).
    """
    num_tokens, num_experts = scores.shape
    probs = scores if score_function == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    weight = None if valid is None else valid.to(probs.dtype)
    if weight is not None:
        probs = probs * weight[:, None]
    per_seq_probs = probs.view(-1, num_sequences, num_experts).sum(dim=0)  # [b, E]
    sequence = torch.arange(num_sequences, device=indices.device).repeat(num_tokens // num_sequences)
    slot = (sequence[:, None] * num_experts + indices).reshape(-1)  # [T*k] in (sequence, expert)
    ones = torch.ones(slot.shape, dtype=probs.dtype, device=probs.device) if weight is None \
        else weight[:, None].expand_as(indices).reshape(-1)
    counts = torch.zeros(num_sequences * num_experts, dtype=probs.dtype, device=probs.device)
    counts = counts.scatter_add_(0, slot, ones).view(num_sequences, num_experts)
    n = 1 if shards is None else shards.size
    if n > 1:
        if weight is not None:
            raise ValueError("sequence_load_balancing_loss: padding masks are not supported with sequence shards")
        counts = shards.total(counts)
    if weight is None:
        seq_tokens = torch.full((num_sequences, 1), n * (num_tokens // num_sequences), dtype=probs.dtype,
                                device=probs.device)
    else:  # an all-padding sequence adds 0
        seq_tokens = weight.view(-1, num_sequences).sum(dim=0).clamp(min=1)[:, None]
    per_seq = (counts / (seq_tokens * top_k) * per_seq_probs / seq_tokens).sum(dim=-1)
    return coeff * num_experts * per_seq.mean()


def z_loss(logits: torch.Tensor, coeff: float, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """coeff * mean over tokens of logsumexp(logits)^2 (ST-MoE router z-loss)."""
    per_token = torch.logsumexp(logits, dim=-1).square()
    if valid is None:
        return coeff * per_token.mean()
    per_token = per_token * valid.to(per_token.dtype)
    return coeff * per_token.sum() / _token_count(valid, per_token.shape[0], per_token)


class AuxLossScaler(MoEAuxLossAutoScaler):
    """megatron-core's MoEAuxLossAutoScaler: forward(output, aux_loss) = output, and backward gives
    aux_loss the gradient megatron-core's scale (`MoEAuxLossAutoScaler.main_loss_backward_scale`).

    One scale for megatron's MoE and ours: megatron-core's pipeline schedules set it every
    micro-batch (`loss_scale * cp_size / num_microbatches`), and our own loop does the same through
    `set_aux_loss_scale`. Forward returns a copy unless told not to (see there); backward reads the
    scale on the aux loss's device, where compat/aux_loss_scale.py keeps it.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, copy: bool = True):
        ctx.save_for_backward(aux_loss)
        # copy: a fresh tensor, not the input, for a caller that may modify it in place (bias-dropout-
        # add does), which autograd forbids on an input a custom Function returns as is; the MoE
        # layer attaches its losses to a tensor nothing modifies and passes copy=False
        return output.clone() if copy else output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # megatron-core's, reading its scale where the aux loss lives: a scale set from a Python
        # float is made on the CPU, and a CUDA aux loss cannot be multiplied by it there
        (aux_loss,) = ctx.saved_tensors
        return grad_output, aux_loss_gradient(aux_loss), None

    @staticmethod
    def set_loss_scale(scale) -> None:
        """Gradient the aux losses get per unit of their value: a float or a tensor of one element."""
        set_scale(scale)


def aux_loss_gradient(aux_loss: torch.Tensor) -> torch.Tensor:
    """The gradient an aux loss gets in backward: megatron-core's scale (see AuxLossScaler), read on
    the loss's device; the scale tensor itself shaped like the loss (a 0-dim view, no launch when the
    dtypes agree, as they do for fp32 losses). For autograd functions that take an aux loss as an
    input of their own instead of going through AuxLossScaler."""
    scale = scale_on(aux_loss.device)
    return scale.to(aux_loss.dtype).reshape(aux_loss.shape)


def set_aux_loss_scale(loss_scale, num_micro_batches: int, cp_size: int = 1) -> None:
    """What megatron-core's schedule sets before each micro-batch's backward (without
    calculate_per_token_loss): the main loss's scale (the fp16 loss scale, or 1) times the
    context-parallel size over the number of micro-batches."""
    set_scale(torch.as_tensor(loss_scale, dtype=torch.float32) * cp_size / num_micro_batches)
