"""Per-layer MoE metrics: aux-loss values and expert loads, accumulated on device without host syncs.

Layers call `record` in training forwards with gradients enabled (so a forward repeated for
activation recompute and eval forwards record nothing). The training loop calls `snapshot` at log
time and `reset` after it. Loss values are the coefficient-weighted values that enter the loss
(before the AuxLossScaler's scale), averaged over the recorded micro-batches; loads are summed.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch


class _LayerRecord:
    __slots__ = ("lb_sum", "lb_count", "z_sum", "z_count", "load")

    def __init__(self):
        self.lb_sum = self.z_sum = self.load = None
        self.lb_count = self.z_count = 0


def _add(total, value):
    value = value.detach()
    return value.clone() if total is None else total + value


class MoEMetrics:
    def __init__(self):
        self._layers: Dict[int, _LayerRecord] = {}

    def record(
        self,
        layer_number: int,
        lb_loss: Optional[torch.Tensor] = None,
        z_loss: Optional[torch.Tensor] = None,
        tokens_per_expert: Optional[torch.Tensor] = None,
    ) -> None:
        rec = self._layers.setdefault(layer_number, _LayerRecord())
        if lb_loss is not None:
            rec.lb_sum, rec.lb_count = _add(rec.lb_sum, lb_loss), rec.lb_count + 1
        if z_loss is not None:
            rec.z_sum, rec.z_count = _add(rec.z_sum, z_loss), rec.z_count + 1
        if tokens_per_expert is not None:
            rec.load = _add(rec.load, tokens_per_expert)

    def reset(self) -> None:
        self._layers.clear()

    def snapshot(self, group=None) -> dict:
        """Python floats of everything recorded since the last reset.

        With `group`, sums (losses, their counts, loads) are all-reduced over it first; every rank
        of the group must call this with the same layers recorded. Returns
        {"lb_loss": mean over layers, "z_loss": ..., "load_imbalance": mean over layers of max/mean
        load, "load_imbalance_max": the largest, "layers": {layer_number: {"lb_loss", "z_loss",
        "load": [per expert], "load_imbalance"}}}; keys whose quantity was not recorded are left out.
        """
        numbers = sorted(self._layers)
        if not numbers:
            return {}
        records = [self._layers[n] for n in numbers]
        device = next(
            t.device for r in records for t in (r.lb_sum, r.z_sum, r.load) if t is not None
        )
        # one flat float64 vector (one collective, exact for counts) of [lb, n_lb, z, n_z, load...] per layer
        parts = []
        for r in records:
            parts.append(
                torch.stack(
                    [
                        _scalar(r.lb_sum, device),
                        torch.tensor(float(r.lb_count), dtype=torch.float64, device=device),
                        _scalar(r.z_sum, device),
                        torch.tensor(float(r.z_count), dtype=torch.float64, device=device),
                    ]
                )
            )
            if r.load is not None:
                parts.append(r.load.to(device=device, dtype=torch.float64).reshape(-1))
        flat = torch.cat(parts)
        if group is not None:
            torch.distributed.all_reduce(flat, group=group)
        values = flat.tolist()

        result: dict = {"layers": {}}
        lbs, zs, imbalances = [], [], []
        pos = 0
        for n, r in zip(numbers, records):
            lb_sum, lb_count, z_sum, z_count = values[pos : pos + 4]
            pos += 4
            layer: dict = {}
            if lb_count:
                layer["lb_loss"] = lb_sum / lb_count
                lbs.append(layer["lb_loss"])
            if z_count:
                layer["z_loss"] = z_sum / z_count
                zs.append(layer["z_loss"])
            if r.load is not None:
                load = values[pos : pos + r.load.numel()]
                pos += r.load.numel()
                layer["load"] = load
                mean = sum(load) / len(load)
                if mean > 0:
                    layer["load_imbalance"] = max(load) / mean
                    imbalances.append(layer["load_imbalance"])
            result["layers"][n] = layer
        if lbs:
            result["lb_loss"] = sum(lbs) / len(lbs)
        if zs:
            result["z_loss"] = sum(zs) / len(zs)
        if imbalances:
            result["load_imbalance"] = sum(imbalances) / len(imbalances)
            result["load_imbalance_max"] = max(imbalances)
        return result


def _scalar(total: Optional[torch.Tensor], device) -> torch.Tensor:
    if total is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return total.to(device=device, dtype=torch.float64).reshape(())


_TRACKER = MoEMetrics()


def get_moe_metrics() -> MoEMetrics:
    """The process's tracker, shared by every MoE layer."""
    return _TRACKER
