"""Autoregressive generation with megatron-core's key-value cache: one prefill of the prompt, then
one token per step, stopping at the end-of-document token, the token limit or the context length."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_dmoe.inference.kv_cache import static_kv_cache
from megatron_dmoe.inference.run_model import unwrapped
from megatron_dmoe.inference.sampling import Sampling, next_token


@dataclass
class Generation:
    tokens: List[int]  # the generated tokens (without the end-of-document token)
    stop_reason: str  # "eod" | "max_tokens" | "context"


def _model_dtype(model) -> torch.dtype:
    return next(unwrapped(model).parameters()).dtype


@torch.no_grad()
def _logits(model, tokens: torch.Tensor, start: int, context) -> torch.Tensor:
    """fp32 logits [b, V] of the last position of `tokens` [b, s], which start at `start`."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
    context.sequence_len_offset += tokens.shape[1]
    return logits[:, -1, :].float()


@torch.no_grad()
def generate(model, prompt: Sequence[int], *, max_new_tokens: int, context_length: int, eod: int,
             vocab_size: int, sampling: Sampling = Sampling(),
             generator: Optional[torch.Generator] = None, device: Optional[torch.device] = None) -> Generation:
    """Generate after `prompt` (token ids) with `model` (in eval mode).

    context_length: the model's; prompt and output together never exceed it. vocab_size: the
    tokenizer's; logits of the embedding's padding rows are never chosen.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) > context_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens, more than the model's context of {context_length}")
    device = device or next(unwrapped(model).parameters()).device
    length = min(context_length, len(prompt) + max_new_tokens)
    cache = static_kv_cache(unwrapped(model), 1, length, device, _model_dtype(model))
    out: List[int] = []
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    start = 0  # position of tokens[0, 0]
    while len(out) < max_new_tokens:
        if len(prompt) + len(out) >= context_length:  # no position left for another token
            return Generation(out, "context")
        logits = _logits(model, tokens, start, cache)
        logits[:, vocab_size:] = float("-inf")
        token = int(next_token(logits, sampling, generator)[0])
        if token == eod:
            return Generation(out, "eod")
        out.append(token)
        start += tokens.shape[1]
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)
    return Generation(out, "max_tokens")
