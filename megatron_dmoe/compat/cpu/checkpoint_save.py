"""dist_checkpointing's torch_dist save finished on the host.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1): the writer's
`preload_tensors` copies with `non_blocking=True` and then synchronises the CUDA device, and
`save_state_dict_async_finalize` gathers the ranks' failure flags in a tensor on
`torch.cuda.current_device()`. Could go once upstream synchronises only after copies from a CUDA
device and makes the flag on the process group's device.
"""
from __future__ import annotations

from megatron_dmoe.compat import mcore as mcore_compat
from megatron_dmoe.compat.cpu.devices import host_only, run_on_cpu


def save_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    preload = writer.preload_tensors
    # non_blocking=False: host tensors need no device synchronisation.
    writer.preload_tensors = staticmethod(host_only(lambda buckets, non_blocking=True: preload(buckets, False),
                                                    preload))
    for home in mcore_compat.checkpoint_finalize_homes():  # where this megatron-core looks it up
        home.save_state_dict_async_finalize = run_on_cpu(home.save_state_dict_async_finalize)
