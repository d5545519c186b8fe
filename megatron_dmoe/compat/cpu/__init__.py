"""megatron-core on a machine without CUDA: its CUDA-minded code paths that our CPU runs reach,
redirected to the host. `apply_cpu_compat()` applies them all; init_distributed calls it when a
run is on the CPU and `leave_host()` when a run is on CUDA: the patches act only while the
process's run is on the host, so that a CUDA run after a CPU one in the same process (a notebook,
an export then a GPU evaluation) gets megatron-core unchanged. Each module says which releases need
it and what upstream would change.

devices.py          the wrappers the others apply, and the switch (not a patch itself)
allocations.py      global memory buffer, DDP gradient buffers, RoPE table, default causal mask
grad_sync.py        DDP's gradient sync without a CUDA stream (0.19)
checkpoint_save.py  dist_checkpointing's torch_dist save finished on the host
rng.py              the named RNG streams as CPU generator states; seed_rng_trackers
pipeline.py         pipeline schedules and point-to-point exchange on gloo
optimizer.py        grad scaler, gradient clip, (distributed) optimizer on gloo
tensor_parallel.py  tensor- and sequence-parallel mappings and linears on gloo
"""
from __future__ import annotations

from megatron_dmoe.compat.cpu.devices import set_on_host

_applied = False


def leave_host() -> None:
    """The process's next run is on CUDA: the patches, if applied, pass every call through."""
    set_on_host(False)


def apply_cpu_compat() -> None:
    """Make megatron-core's CUDA assumptions hold on CPU, from now until leave_host() (the
    patches are applied once; later calls turn them back on)."""
    global _applied
    set_on_host(True)
    if _applied:
        return
    from megatron_dmoe.compat.cpu.allocations import allocate_on_host
    from megatron_dmoe.compat.cpu.checkpoint_save import save_on_host
    from megatron_dmoe.compat.cpu.grad_sync import sync_without_streams
    from megatron_dmoe.compat.cpu.optimizer import optimizers_on_host
    from megatron_dmoe.compat.cpu.pipeline import pipeline_on_host
    from megatron_dmoe.compat.cpu.rng import track_rng_on_host
    from megatron_dmoe.compat.cpu.tensor_parallel import tensor_parallel_on_host

    allocate_on_host()
    sync_without_streams()
    save_on_host()
    track_rng_on_host()
    pipeline_on_host()
    optimizers_on_host()
    tensor_parallel_on_host()
    _applied = True
