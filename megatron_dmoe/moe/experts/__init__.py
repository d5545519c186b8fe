"""Expert MLP backends: `sparse` (block-sparse Triton kernels), `grouped` (torch grouped_mm), `reference` (per-expert loop)."""
from .backends import BACKENDS, BackendUnavailableError, register_backend, resolve_backend
from .module import ExpertMLP

__all__ = ["BACKENDS", "BackendUnavailableError", "ExpertMLP", "register_backend", "resolve_backend"]
