"""The means by which the CPU patches in this folder redirect megatron-core's CUDA tensors.

Not a patch itself: the wrappers and stand-ins the patch modules apply. Each swaps a torch
attribute only while the wrapped megatron-core call runs (compat/patching.py), so nothing outside
megatron-core sees a changed torch, and only while the process's run is on the host (`on_host`):
otherwise every wrapper calls what it wraps unchanged.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from megatron_dmoe.compat.patching import patched

_on_host = False


def on_host() -> bool:
    """Whether the process's current run is on the CPU (the patches act only then)."""
    return _on_host


def set_on_host(value: bool) -> None:
    global _on_host
    _on_host = value


def host_only(replacement, original):
    """`replacement` while the run is on the host, `original` otherwise (same arguments)."""
    @functools.wraps(original)
    def either(*args, **kwargs):
        return (replacement if _on_host else original)(*args, **kwargs)

    return either


def run_on_cpu(method):
    """`method` with `torch.cuda.current_device()` answering 'cpu' while it runs: the buffers it
    allocates on the current device are made on the host."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not _on_host:
            return method(*args, **kwargs)
        with patched(torch.cuda, "current_device", lambda: "cpu"):
            return method(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def tensor_cuda_is_identity() -> Iterator[None]:
    """`tensor.cuda()` returns the tensor itself (a CPU run has no device to move to)."""
    if not _on_host:
        yield
        return
    with patched(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        yield


def _host_device(device):
    """'cuda' (any form) -> 'cpu'; other devices as given."""
    if device is None or isinstance(device, int):
        return "cpu" if isinstance(device, int) else device
    return "cpu" if torch.device(device).type == "cuda" else device


def _made_on_host(factory):
    @functools.wraps(factory)
    def make(*args, device=None, **kwargs):
        return factory(*args, device=_host_device(device) if _on_host else device, **kwargs)

    return make


class TorchOnCpu:
    """`torch` as seen by the megatron-core modules it replaces `torch` in (their module global):
    tensors asked for on 'cuda' are made on the CPU, the current device is the CPU, and device
    synchronisation is a no-op; everything else is torch itself."""

    class _Cuda:
        @staticmethod
        def current_device():
            return "cpu" if _on_host else torch.cuda.current_device()

        @staticmethod
        def synchronize(*args, **kwargs):
            return None if _on_host else torch.cuda.synchronize(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    cuda = _Cuda()
    tensor = staticmethod(_made_on_host(torch.tensor))
    zeros = staticmethod(_made_on_host(torch.zeros))
    ones = staticmethod(_made_on_host(torch.ones))
    empty = staticmethod(_made_on_host(torch.empty))

    def __getattr__(self, name):
        return getattr(torch, name)
