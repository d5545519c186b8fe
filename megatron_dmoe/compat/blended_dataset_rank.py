"""A process without torch.distributed counts as rank 0 while megatron-core builds datasets.

megatron-core 0.16 (checked: 0.16.1) asks `torch.distributed.get_rank()` in BlendedDataset on an
index-cache miss even when torch.distributed is not initialised, which raises; 0.19.1 checks
`is_initialized()` first, and there this changes nothing. Could go with 0.16's support.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_dmoe.compat.patching import patched


@contextlib.contextmanager
def rank_zero_without_distributed() -> Iterator[None]:
    """Inside the block, an uninitialised torch.distributed answers get_rank() with 0."""
    dist = torch.distributed
    if dist.is_initialized():
        yield
        return
    original = dist.get_rank
    with patched(dist, "get_rank", lambda group=None: 0 if not dist.is_initialized() else original(group)):
        yield
