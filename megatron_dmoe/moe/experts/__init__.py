"""Expert MLP backends: `sparse` (block-sparse Triton kernels), `grouped` (torch grouped_mm),
`reference` (per-expert loop)."""
from .backends import BACKEND_REGISTRY, resolve_backend
from .module import ExpertMLP

__all__ = ["BACKEND_REGISTRY", "ExpertMLP", "resolve_backend"]
