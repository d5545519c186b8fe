"""MoE metrics of the whole model when pipeline stages hold different layers."""
from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist
from megatron.core import parallel_state as ps


def over_pipeline(snapshot: Dict[str, Any]) -> Dict[str, Any]:
    """A `MoEMetrics.snapshot()` of every pipeline stage's layers, on every stage: the per-layer
    values are gathered over the pipeline group and the averages over layers formed again (the
    snapshot as is without pipeline parallelism)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return snapshot
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, snapshot.get("layers") or {}, group=ps.get_pipeline_model_parallel_group())
    layers = {n: layer for part in parts for n, layer in part.items()}
    if not layers:
        return {}
    merged: Dict[str, Any] = {"layers": layers}
    for key in ("lb_loss", "z_loss"):
        values = [layer[key] for layer in layers.values() if key in layer]
        if values:
            merged[key] = sum(values) / len(values)
    imbalances = [layer["load_imbalance"] for layer in layers.values() if "load_imbalance" in layer]
    if imbalances:
        merged["load_imbalance"] = sum(imbalances) / len(imbalances)
        merged["load_imbalance_max"] = max(imbalances)
    return merged
