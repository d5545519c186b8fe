"""Global-batch load balancing (moe.aux_loss_type: global; megatron-core's global_aux_loss).

The Switch loss coeff * E * sum_i f_i * P_i with the expert fractions f_i counted over the whole
step: every micro-batch so far and every data-parallel rank, not just the micro-batch (arXiv
2501.11873: a micro-batch of one domain is not expected to be balanced on its own).

A micro-batch's backward runs before later micro-batches are routed, so, as in megatron-core, the
loss that gets a gradient uses the fractions counted up to this micro-batch; the last micro-batch
of a step uses the whole step's. `GlobalLoadBalance.step_loss()` is the exact value over the
whole global batch (what `load_balancing_loss` gives on all of its tokens at once), whatever
the split into micro-batches and ranks.

The running sums are device buffers updated in place (a captured CUDA graph replays the same
updates) and are owned by each router; the training step zeroes them through
`reset_global_load_balance(model)` before its first micro-batch.
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch


def _default_group():
    """Ranks whose tokens form the global batch: data-parallel with context parallelism, and tensor
    parallelism too (with sequence parallelism its ranks hold different tokens; without it they hold
    the same ones, which leaves every fraction unchanged)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return None


class GlobalLoadBalance(torch.nn.Module):
    """Running sums of one router over the step: assignments per expert, tokens, router probability
    mass per expert (detached; only for `step_loss`). float64, so counts stay exact."""

    def __init__(self, num_experts: int, device=None, group=None):
        super().__init__()
        self.group = group
        # one buffer, so one all-reduce per micro-batch: [counts E | probability mass E | tokens 1]
        self.register_buffer("sums", torch.zeros(2 * num_experts + 1, dtype=torch.float64, device=device),
                             persistent=False)
        self.num_experts = num_experts

    def _apply(self, fn, *args, **kwargs):
        # mixed-precision wrappers cast floating buffers; counts must stay exact
        result = super()._apply(fn, *args, **kwargs)
        if self.sums.dtype != torch.float64:
            self.sums = self.sums.to(torch.float64)
        return result

    @torch.no_grad()
    def reset(self) -> None:
        self.sums.zero_()

    def loss(self, probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, coeff: float,
             valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This micro-batch's loss: its mean router probabilities `probs` [T, E] (already normalised
        per token) against the fractions counted over the step so far, this micro-batch included.
        tokens_per_expert [E] counts this rank's valid assignments; valid [T] bool or None."""
        E = self.num_experts
        if valid is not None:
            probs = probs * valid.to(probs.dtype)[:, None]
            num_tokens = valid.sum().to(torch.float64)
        else:
            num_tokens = torch.full((), probs.shape[0], dtype=torch.float64, device=probs.device)
        local = torch.cat([tokens_per_expert.to(torch.float64), probs.detach().sum(dim=0).to(torch.float64),
                           num_tokens.reshape(1)])
        group = self.group if self.group is not None else _default_group()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(local, group=group)
        with torch.no_grad():
            self.sums.add_(local)
        counts, total = self.sums[:E], self.sums[-1:]
        fraction = (counts / (total.clamp(min=1) * top_k)).to(probs.dtype)
        mean_prob = probs.sum(dim=0) / num_tokens.clamp(min=1).to(probs.dtype)
        return coeff * E * torch.sum(fraction * mean_prob)

    @torch.no_grad()
    def step_loss(self, top_k: int, coeff: float) -> torch.Tensor:
        """The loss over every token routed since the last reset, at once (float64)."""
        E = self.num_experts
        counts, mass, total = self.sums[:E], self.sums[E:2 * E], self.sums[-1].clamp(min=1)
        return coeff * E * torch.sum(counts / (total * top_k) * mass / total)


def reset_global_load_balance(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> int:
    """Zero the running sums of every router with a global aux loss (start of a training step).
    `model` is a module or a list of model chunks; returns the number of routers reset."""
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    states = [m for chunk in modules for m in chunk.modules() if isinstance(m, GlobalLoadBalance)]
    for state in states:
        state.reset()
    return len(states)
