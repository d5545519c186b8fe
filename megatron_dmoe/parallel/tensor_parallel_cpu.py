"""Run megatron-core's tensor- and sequence-parallel communication on CPU.

Its mappings (the all-gathers and reduce-scatters around the parallel linears and the sequence-
parallel regions) and the linear layer's autograd function allocate their output buffers on
`torch.cuda.current_device()`. gloo performs the collectives themselves on host tensors, so
pointing those allocations at the CPU is all a CPU run needs. Applied with `apply_cpu_compat()`
by init_distributed on CPU; idempotent.
"""
from __future__ import annotations

from megatron_dmoe.parallel.cpu_compat import _run_on_cpu

_applied = False


def _wrap_static(cls, name: str) -> None:
    setattr(cls, name, staticmethod(_run_on_cpu(getattr(cls, name))))


def apply_tensor_parallel_cpu_compat() -> None:
    """Redirect the buffers of megatron-core's tensor-parallel mappings and linears to the CPU."""
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import layers, mappings

    for name in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        setattr(mappings, name, _run_on_cpu(getattr(mappings, name)))
    _wrap_static(mappings._AllToAll, "forward")
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    _wrap_static(linear, "forward")
    _wrap_static(linear, "backward")
    _applied = True
