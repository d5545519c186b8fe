"""megatron-core's forward-backward schedules kept from capturing CUDA graphs themselves.

megatron-core (0.16 through 0.19, checked: 0.16.1, 0.19.1) calls `create_cudagraphs()` at the end
of every schedule (forward_backward_no_pipelining and both pipelined schedules), looked up in the
schedules module, with no option to leave it out. training/cuda_graphs.py captures later itself,
once the step's deferred expert weight gradients are done. Could go once upstream's schedules take
a flag (or a config field) that leaves capture to the caller.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_dmoe.compat.patching import patched


def _no_capture(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def schedules_leave_capture() -> Iterator[None]:
    """Inside the block, megatron-core's schedules capture nothing at their end."""
    from megatron.core.pipeline_parallel import schedules

    with patched(schedules, "create_cudagraphs", _no_capture):
        yield
