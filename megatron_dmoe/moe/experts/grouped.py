"""`grouped` backend: torch.nn.functional.grouped_mm over the expert-grouped rows.

Group boundaries stay on the device (int32 offsets), so no count comes back to the host.
grouped_mm needs every row stride to be a multiple of 16 bytes: hidden and ffn sizes must be
multiples of 16 / element size (4 for fp32, 8 for bf16); which dtypes it takes depends on the device.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .gemm import GroupedGemm
from .mlp import GemmBackend

_ALIGN_BYTES = 16


class GroupedMMGemm(GroupedGemm):
    def __init__(self, tokens_per_expert: torch.Tensor):
        self.offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)

    def nt(self, x, w):
        return F.grouped_mm(x.contiguous(), w.transpose(1, 2), offs=self.offs)

    def nn(self, x, w):
        return F.grouped_mm(x.contiguous(), w, offs=self.offs)

    def tn(self, a, b):
        return F.grouped_mm(a.contiguous().t(), b.contiguous(), offs=self.offs)


@functools.lru_cache(maxsize=None)
def _runs_on(device_type: str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs the three products we use for this device type and dtype (tried once)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        device = torch.device(device_type)
        gemm = GroupedMMGemm(torch.tensor([2, 3], device=device))
        x = torch.ones(5, 16, dtype=dtype, device=device)
        w = torch.ones(2, 16, 16, dtype=dtype, device=device)
        gemm.nt(x, w), gemm.nn(x, w), gemm.tn(x, x)
        return True
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False


class GroupedBackend(GemmBackend):
    name = "grouped"

    def unsupported_reason(self, device, dtype, hidden_size, ffn_hidden_size):
        if not hasattr(F, "grouped_mm"):
            return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
        if not _runs_on(torch.device(device).type, dtype):
            return f"torch.nn.functional.grouped_mm does not run in {dtype} on {torch.device(device).type}"
        multiple = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        for key, size in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if size % multiple:
                return (
                    f"{key}={size} is not a multiple of {multiple}, which grouped_mm needs in {dtype} "
                    "(16-byte row strides)"
                )
        return None

    def make_gemm(self, tokens_per_expert):
        return GroupedMMGemm(tokens_per_expert)
