"""DDP's gradient sync on CPU without a CUDA stream.

Needed by megatron-core 0.19 (checked: 0.19.1; 0.16 does not ask): `_ParamAndGradBucketGroup.
start_grad_sync` takes `torch.cuda.current_stream()` to wait for CUDA-graph replays even when it
has no event to wait for, which a machine without CUDA cannot answer. Could go once upstream asks
for the stream only when there are events (or the buffers are on CUDA).
"""
from __future__ import annotations

import functools

import torch

from megatron_dmoe.compat.cpu.devices import on_host
from megatron_dmoe.compat.patching import patched


class _NoStream:
    """Stands in for the current CUDA stream: a CPU run has no events to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def _without_cuda_streams(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not on_host():
            return method(*args, **kwargs)
        with patched(torch.cuda, "current_stream", lambda *a, **k: _NoStream()):
            return method(*args, **kwargs)

    return wrapper


def sync_without_streams() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core.distributed import param_and_grad_buffer

    bucket_group = param_and_grad_buffer._ParamAndGradBucketGroup
    bucket_group.start_grad_sync = _without_cuda_streams(bucket_group.start_grad_sync)
