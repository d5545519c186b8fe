"""The softmax top-k router without autograd: one launch forward (plus the column sums' reduction),
one launch backward. The kernels are in kernels.py; autograd in functional.py.

  route_forward(logits, top_k, renormalize=False, scale=1.0, valid=None)
      -> indices [T, k] int64, weights [T, k], scores [T, E], colsum [E] (all fp32 but indices)
  route_backward(scores, indices, d_weights, d_colsum, d_scores=None, renormalize=False, scale=1.0,
                 valid=None) -> d_logits [T, E]

scores = softmax(logits); indices: each row's k largest probabilities in descending order (the
lowest expert index first among equal logits); weights: those probabilities, divided by their sum
(+ 1e-20) when renormalize, times scale; colsum[e] = sum over the valid tokens of scores[t, e] (the
load-balancing loss's column sums). The column sums are written per program and summed by one
torch reduction: the same logits give the same bits on every run, which atomics into a zeroed
buffer (a memset and a launch too) would not.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..launch import cdiv, check_launchable, direct, next_power_of_2
from . import kernels as _kernels

MAX_EXPERTS = 256  # one program holds [BLOCK_T, next_pow2(E)] in registers
_TILE_ELEMENTS = 4096  # elements of a program's tile: 32 per thread at 4 warps
_MAX_BLOCK_T = 64


def _block_t(e_pow2: int) -> int:
    return max(1, min(_MAX_BLOCK_T, _TILE_ELEMENTS // e_pow2))


def _check_valid(valid: Optional[torch.Tensor], num_tokens: int, device: torch.device):
    if valid is None:
        return None
    if valid.shape != (num_tokens,) or valid.dtype != torch.bool or valid.device != device:
        raise ValueError(f"route: valid must be a bool tensor [{num_tokens}] on {device}, got "
                         f"{valid.dtype} {tuple(valid.shape)} on {valid.device}")
    return valid.contiguous().view(torch.uint8)


def route_forward(logits: torch.Tensor, top_k: int, renormalize: bool = False, scale: float = 1.0,
                  valid: Optional[torch.Tensor] = None):
    """(indices, weights, scores, colsum) of fp32 logits [T, E]; valid [T] bool or None (all valid)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"route: logits must be a 2-D fp32 tensor [tokens, experts], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"route: {E} experts; the fused router supports 1 to {MAX_EXPERTS} (use torch's route)")
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k={top_k} must be between 1 and the number of experts ({E})")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    valid_bytes = _check_valid(valid, T, device)
    e_pow2 = next_power_of_2(E)
    block_t = _block_t(e_pow2)
    programs = cdiv(T, block_t)
    scores = torch.empty(T, E, dtype=torch.float32, device=device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=device)
    if T == 0:
        return indices, weights, scores, torch.zeros(E, dtype=torch.float32, device=device)
    partial = torch.empty(programs, E, dtype=torch.float32, device=device)
    check_launchable(_kernels.route_forward_kernel, device)
    direct(_kernels.route_forward_kernel)[(programs,)](
        logits, scores, weights, indices, partial, valid_bytes if valid_bytes is not None else logits,
        T, E, logits.stride(0), float(scale),
        K=top_k, K_POW2=next_power_of_2(top_k), E_POW2=e_pow2, BLOCK_T=block_t,
        RENORMALIZE=bool(renormalize), HAS_SCALE=float(scale) != 1.0, HAS_VALID=valid_bytes is not None,
        num_warps=4,
    )
    colsum = partial[0] if programs == 1 else partial.sum(dim=0)
    return indices, weights, scores, colsum


def route_backward(scores: torch.Tensor, indices: torch.Tensor, d_weights: Optional[torch.Tensor],
                   d_colsum: Optional[torch.Tensor], d_scores: Optional[torch.Tensor] = None,
                   renormalize: bool = False, scale: float = 1.0,
                   valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d_logits [T, E] fp32 from the gradients of weights [T, k], colsum [E] and scores [T, E]
    (each may be None: no gradient), given route_forward's scores and indices."""
    T, E = scores.shape
    K = indices.shape[1]
    device = scores.device
    for name, t, shape in (("d_weights", d_weights, (T, K)), ("d_colsum", d_colsum, (E,)),
                           ("d_scores", d_scores, (T, E))):
        if t is not None and (tuple(t.shape) != shape or t.device != device):
            raise ValueError(f"route_backward: {name} must be {list(shape)} on {device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    d_weights, d_colsum, d_scores = (None if t is None else t.to(torch.float32).contiguous()
                                     for t in (d_weights, d_colsum, d_scores))
    valid_bytes = _check_valid(valid, T, device)
    d_logits = torch.empty(T, E, dtype=torch.float32, device=device)
    if T == 0:
        return d_logits
    e_pow2 = next_power_of_2(E)
    block_t = _block_t(e_pow2)
    check_launchable(_kernels.route_backward_kernel, device)
    direct(_kernels.route_backward_kernel)[(cdiv(T, block_t),)](
        scores, indices.contiguous(), d_weights if d_weights is not None else scores,
        d_colsum if d_colsum is not None else scores, d_scores if d_scores is not None else scores,
        valid_bytes if valid_bytes is not None else scores, d_logits,
        T, E, float(scale),
        K=K, K_POW2=next_power_of_2(K), E_POW2=e_pow2, BLOCK_T=block_t,
        RENORMALIZE=bool(renormalize), HAS_DW=d_weights is not None, HAS_DCOLSUM=d_colsum is not None,
        HAS_DSCORES=d_scores is not None, HAS_VALID=valid_bytes is not None,
        num_warps=4,
    )
    return d_logits


def balance_loss(colsum: torch.Tensor, counts: torch.Tensor, scale: float, record=None) -> torch.Tensor:
    """scale * <counts, colsum>, a 0-dim fp32 tensor, in one launch: the load-balancing loss from
    route_forward's column sums and the assignments per expert (any integer dtype).

    record: None, or running sums (lb_sum 0-dim fp64, lb_count 0-dim fp64, load [E]) that the same
    launch updates in place: lb_sum += loss, lb_count += 1, load += counts.
    """
    E = colsum.shape[0]
    if colsum.dtype != torch.float32 or tuple(counts.shape) != (E,) or counts.device != colsum.device:
        raise ValueError(f"balance_loss: colsum must be fp32 [E] and counts [E] on its device, got "
                         f"{colsum.dtype} {tuple(colsum.shape)} and {tuple(counts.shape)} on {counts.device}")
    loss = torch.empty((), dtype=torch.float32, device=colsum.device)
    if record is not None:
        lb_sum, lb_count, load = record
        if lb_sum.dtype != torch.float64 or lb_count.dtype != torch.float64 or tuple(load.shape) != (E,):
            raise ValueError("balance_loss: record must be (lb_sum fp64, lb_count fp64, load [E])")
    check_launchable(_kernels.balance_loss_kernel, colsum.device)
    direct(_kernels.balance_loss_kernel)[(1,)](
        colsum.contiguous(), counts.contiguous(), loss, float(scale),
        *(record if record is not None else (loss, loss, loss)),
        E, BLOCK_E=next_power_of_2(E), RECORD=record is not None,
    )
    return loss


def balance_loss_backward(d_loss: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """d colsum [E] fp32 of balance_loss: d_loss * scale * counts, in one launch."""
    E = counts.shape[0]
    d_colsum = torch.empty(E, dtype=torch.float32, device=counts.device)
    check_launchable(_kernels.balance_loss_backward_kernel, counts.device)
    direct(_kernels.balance_loss_backward_kernel)[(1,)](
        d_loss.to(torch.float32).contiguous(), counts.contiguous(), d_colsum, float(scale), E,
        BLOCK_E=next_power_of_2(E),
    )
    return d_colsum
