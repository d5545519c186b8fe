"""megatron-core's tensor- and sequence-parallel communication on gloo.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1): its mappings (the all-gathers
and reduce-scatters around the parallel linears and the sequence-parallel regions, the all-to-all)
and the linear layer's autograd function allocate their output buffers on
`torch.cuda.current_device()`. gloo performs the collectives themselves on host tensors, so pointing
those allocations at the CPU is all a CPU run needs. Could go once upstream allocates the outputs
on the input's device.
"""
from __future__ import annotations

from megatron_dmoe.compat.cpu.devices import run_on_cpu


def _wrap_static(cls, name: str) -> None:
    setattr(cls, name, staticmethod(run_on_cpu(getattr(cls, name))))


def tensor_parallel_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core.tensor_parallel import layers, mappings

    for name in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        setattr(mappings, name, run_on_cpu(getattr(mappings, name)))
    _wrap_static(mappings._AllToAll, "forward")
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    _wrap_static(linear, "forward")
    _wrap_static(linear, "backward")
