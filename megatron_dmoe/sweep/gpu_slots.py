"""The GPUs of each slot when a local sweep trains several runs at once (`dmoe-sweep --concurrent`).

Slot s of N takes P = --nproc-per-node devices, s*P ... s*P+P-1, given to its run through
CUDA_VISIBLE_DEVICES. When the sweep itself was started with CUDA_VISIBLE_DEVICES, those numbers
index into that list, so a sweep confined to some GPUs stays on them. On a machine without GPUs the
runs share the CPU and the environment is left as it is.
"""
from __future__ import annotations

from typing import List, Optional


def gpu_count() -> int:
    """The GPUs this process sees (after its own CUDA_VISIBLE_DEVICES)."""
    import torch

    return torch.cuda.device_count()


def slot_devices(concurrent: int, nproc_per_node: int, device_count: int,
                 parent_visible: Optional[str] = None) -> List[Optional[str]]:
    """CUDA_VISIBLE_DEVICES for each of the ``concurrent`` slots; None: leave it as it is (one
    run at a time, as without --concurrent, or no GPU here).

    Raises ValueError, naming the flags and the numbers, when the slots need more GPUs than
    ``device_count``.
    """
    if concurrent < 1:
        raise ValueError(f"--concurrent must be at least 1, got {concurrent}")
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    if concurrent == 1 or device_count == 0:
        return [None] * concurrent
    if parent_visible is not None:
        devices = [d.strip() for d in parent_visible.split(",") if d.strip()][:device_count]
        seen = f"{len(devices)} (CUDA_VISIBLE_DEVICES={parent_visible})"
    else:
        devices = [str(i) for i in range(device_count)]
        seen = str(device_count)
    need = concurrent * nproc_per_node
    if need > len(devices):
        fit = len(devices) // nproc_per_node
        fix = (f"lower --concurrent to at most {fit}" if fit >= 1
               else f"lower --nproc-per-node to at most {len(devices)}")
        raise ValueError(f"--concurrent {concurrent} with --nproc-per-node {nproc_per_node} needs "
                         f"{need} GPUs, but this machine has {seen}: {fix}")
    return [",".join(devices[s * nproc_per_node:(s + 1) * nproc_per_node])
            for s in range(concurrent)]
