"""The means by which the CPU patches in this folder redirect megatron-core's CUDA tensors.

Not a patch itself: the wrappers and stand-ins the patch modules apply. Each swaps a torch
attribute only while the wrapped megatron-core call runs (compat/patching.py), so nothing outside
megatron-core sees a changed torch.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from megatron_dmoe.compat.patching import patched


def run_on_cpu(method):
    """`method` with `torch.cuda.current_device()` answering 'cpu' while it runs: the buffers it
    allocates on the current device are made on the host."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with patched(torch.cuda, "current_device", lambda: "cpu"):
            return method(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def tensor_cuda_is_identity() -> Iterator[None]:
    """`tensor.cuda()` returns the tensor itself (a CPU run has no device to move to)."""
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
        return factory(*args, device=_host_device(device), **kwargs)

    return make


class TorchOnCpu:
    """`torch` as seen by the megatron-core modules it replaces `torch` in (their module global):
    tensors asked for on 'cuda' are made on the CPU, the current device is the CPU, and device
    synchronisation is a no-op; everything else is torch itself."""

    class _Cuda:
        @staticmethod
        def current_device():
            return "cpu"

        @staticmethod
        def synchronize(*args, **kwargs):
            return None

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    cuda = _Cuda()
    tensor = staticmethod(_made_on_host(torch.tensor))
    zeros = staticmethod(_made_on_host(torch.zeros))
    ones = staticmethod(_made_on_host(torch.ones))
    empty = staticmethod(_made_on_host(torch.empty))

    def __getattr__(self, name):
        return getattr(torch, name)
