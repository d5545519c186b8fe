"""Expert MLP backends: `sparse` (block-sparse Triton kernels), `grouped` (torch grouped_mm),
`reference` (per-expert loop)."""
from .backends import BACKEND_REGISTRY, BackendUnavailableError, register_backend, resolve_backend
from .module import ExpertMLP

__all__ = ["BACKEND_REGISTRY", "BackendUnavailableError", "ExpertMLP", "register_backend", "resolve_backend"]
