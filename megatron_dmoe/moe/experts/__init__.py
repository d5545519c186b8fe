"""Expert MLP backends: `reference` (per-expert loop), `grouped` (torch grouped_mm); 'sparse' is reserved."""
from .backends import BACKENDS, BackendUnavailableError, register_backend, resolve_backend
from .module import ExpertMLP

__all__ = ["BACKENDS", "BackendUnavailableError", "ExpertMLP", "register_backend", "resolve_backend"]
