"""The expert MLP backends by name, and the choice behind backend='auto'.

BACKEND_REGISTRY maps a name to the backend object that runs it, read-only: the names a
configuration may give (with 'auto') are config/moe_settings.py's BACKENDS, and a new backend is added
here, beside them."""
from __future__ import annotations

from types import MappingProxyType

import torch

from .grouped import GroupedBackend
from .mlp import ExpertBackend
from .reference import ReferenceBackend
from .sparse import SparseBackend

BACKEND_REGISTRY: "MappingProxyType[str, ExpertBackend]" = MappingProxyType({
    b.name: b for b in (ReferenceBackend(), GroupedBackend(), SparseBackend())
})
AUTO_ORDER = ("sparse", "grouped", "reference")  # preferred first
# torch's grouped_mm on CPU is a plain loop, slower than per-expert matmuls in our default training
# run (docs/performance.md, "Expert backends on CPU"); the block-sparse kernels run on CPU only
# under Triton's (slow) interpreter. 'auto' keeps both for accelerators.
AUTO_SKIP_ON_CPU = frozenset({"grouped", "sparse"})


def check_backend_name(name: str) -> None:
    """Fail at build time for a backend that cannot exist in this installation."""
    if name == "auto" or name in BACKEND_REGISTRY:
        return
    raise ValueError(f"MoE option 'backend'={name!r} is unknown; use 'auto' or one of {sorted(BACKEND_REGISTRY)}.")


def resolve_backend(name: str, device, dtype: torch.dtype, hidden_size: int, ffn_hidden_size: int) -> ExpertBackend:
    """The backend to run for these inputs; 'auto' takes the first in AUTO_ORDER that can."""
    check_backend_name(name)
    if name == "auto":
        for candidate in AUTO_ORDER:
            if torch.device(device).type == "cpu" and candidate in AUTO_SKIP_ON_CPU:
                continue
            backend = BACKEND_REGISTRY[candidate]
            if backend.unsupported_reason(device, dtype, hidden_size, ffn_hidden_size) is None:
                return backend
        raise RuntimeError(f"no MoE expert backend runs {dtype} on {device}")
    backend = BACKEND_REGISTRY[name]
    reason = backend.unsupported_reason(device, dtype, hidden_size, ffn_hidden_size)
    if reason is not None:
        raise ValueError(
            f"MoE option 'backend'={name!r} cannot run here: {reason}; "
            "use backend='auto' (falls back to 'reference') or change the sizes."
        )
    return backend
