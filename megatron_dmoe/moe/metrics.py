"""Per-layer MoE metrics: aux-loss values and expert loads, accumulated on device without host syncs.

One `MoEMetrics` per run, in its MoE state (moe/run_state.py), shared by the model's MoE layers.
Layers call `record` in training forwards with gradients enabled (so a forward repeated for
activation recompute and eval forwards record nothing). The training loop calls `snapshot` at log
time and `reset` after it. Loss values are the coefficient-weighted values that enter the loss
(before the AuxLossScaler's scale), averaged over the recorded micro-batches; loads are summed.

The same record also goes into megatron-core's aux-loss tracker (`save_to_aux_losses_tracker`),
which Megatron-LM's training loop reads, reduces and logs (`track_moe_metrics`: its log line and
TensorBoard): the losses per unit coefficient under megatron's own names, as megatron's router
writes them, and each layer's expert-load imbalance (max / mean tokens per expert).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

from megatron_dmoe.compat import mcore as mcore_compat

# Names in megatron-core's tracker: megatron's router's own for the losses, so Megatron-LM logs
# ours where it logs its own MoE's.
TRACKER_LB_LOSS = "load_balancing_loss"
TRACKER_Z_LOSS = "z_loss"
TRACKER_LOAD_IMBALANCE = "expert_load_imbalance"
TRACKER_NAMES = (TRACKER_LB_LOSS, TRACKER_Z_LOSS, TRACKER_LOAD_IMBALANCE)


class _LayerRecord:
    """Running sums on the device, updated in place: a forward captured in a CUDA graph replays
    the same additions into the same buffers, so replays are counted like eager calls (counts are
    device tensors for that reason too)."""

    __slots__ = ("lb_sum", "lb_count", "z_sum", "z_count", "load")

    def __init__(self):
        self.lb_sum = self.lb_count = self.z_sum = self.z_count = self.load = None

    def zero_(self) -> None:
        for name in self.__slots__:
            t = getattr(self, name)
            if t is not None:
                t.zero_()


def _sum_buffer(total: Optional[torch.Tensor], shape, dtype: torch.dtype, device) -> torch.Tensor:
    """total, or a new zero buffer for running sums: the first time, or for a new model's shape or
    device."""
    if total is None or total.shape != shape or total.device != device:
        total = torch.zeros(shape, dtype=dtype, device=device)
    return total


def _accumulate(total: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    dtype = torch.float64 if value.is_floating_point() else value.dtype
    return _sum_buffer(total, value.shape, dtype, value.device).add_(value)


def _count(total: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return _sum_buffer(total, (), torch.float64, like.device).add_(1)


class MoEMetrics:
    def __init__(self):
        self._layers: Dict[int, _LayerRecord] = {}
        # whether records also go to megatron-core's tracker, for Megatron-LM's training loop; ours
        # logs these sums itself and turns it off (about ten small launches per layer and forward)
        self.megatron_tracker = True

    def record(
        self,
        layer_number: int,
        lb_loss: Optional[torch.Tensor] = None,
        z_loss: Optional[torch.Tensor] = None,
        tokens_per_expert: Optional[torch.Tensor] = None,
        *,
        num_layers: Optional[int] = None,
        lb_coeff: float = 0.0,
        z_coeff: float = 0.0,
    ) -> None:
        """Add one micro-batch of one layer. With `num_layers` (the model's layer count, megatron's
        tracker is indexed by global layer) and a layer number >= 1, megatron-core's tracker gets the
        same values; `lb_coeff` / `z_coeff` are the coefficients the losses carry."""
        if self.megatron_tracker and num_layers is not None and 1 <= layer_number <= num_layers:
            _save_to_megatron_tracker(layer_number, num_layers, lb_loss, lb_coeff, z_loss, z_coeff,
                                      tokens_per_expert)
        rec = self._layers.setdefault(layer_number, _LayerRecord())
        if lb_loss is not None:
            rec.lb_sum, rec.lb_count = _accumulate(rec.lb_sum, lb_loss), _count(rec.lb_count, lb_loss)
        if z_loss is not None:
            rec.z_sum, rec.z_count = _accumulate(rec.z_sum, z_loss), _count(rec.z_count, z_loss)
        if tokens_per_expert is not None:
            rec.load = _accumulate(rec.load, tokens_per_expert)

    def balance_sums(self, layer_number: int, tokens_per_expert: torch.Tensor):
        """(lb_sum, lb_count, load) of a layer, for a kernel that adds one micro-batch's load-balancing
        loss and loads to them itself (the same buffers `record` adds to)."""
        rec = self._layers.setdefault(layer_number, _LayerRecord())
        device = tokens_per_expert.device
        rec.lb_sum = _sum_buffer(rec.lb_sum, (), torch.float64, device)
        rec.lb_count = _sum_buffer(rec.lb_count, (), torch.float64, device)
        rec.load = _sum_buffer(rec.load, tokens_per_expert.shape, tokens_per_expert.dtype, device)
        return rec.lb_sum, rec.lb_count, rec.load

    def tensors(self):
        """Every accumulator (megatron-core's tracker entries we write included), for callers that
        must save and restore them in place."""
        ours = [t for rec in self._layers.values() for name in _LayerRecord.__slots__
                if (t := getattr(rec, name)) is not None]
        return ours + _megatron_tracker_values()

    def reset(self) -> None:
        """Zero every sum in place (CUDA graphs hold these buffers' addresses), megatron-core's
        tracker entries we write included (our loop logs them itself)."""
        for rec in self._layers.values():
            rec.zero_()
        for values in _megatron_tracker_values():
            values.zero_()

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
                        _scalar(r.lb_count, device),
                        _scalar(r.z_sum, device),
                        _scalar(r.z_count, device),
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
            load = None
            if r.load is not None:
                load = values[pos : pos + r.load.numel()]
                pos += r.load.numel()
            if not (lb_count or z_count or (load and any(load))):
                continue  # nothing recorded since the last reset
            layer: dict = {}
            if lb_count:
                layer["lb_loss"] = lb_sum / lb_count
                lbs.append(layer["lb_loss"])
            if z_count:
                layer["z_loss"] = z_sum / z_count
                zs.append(layer["z_loss"])
            if load is not None:
                layer["load"] = load
                mean = sum(load) / len(load)
                if mean > 0:
                    layer["load_imbalance"] = max(load) / mean
                    imbalances.append(layer["load_imbalance"])
            result["layers"][n] = layer
        if not result["layers"]:
            return {}
        if lbs:
            result["lb_loss"] = sum(lbs) / len(lbs)
        if zs:
            result["z_loss"] = sum(zs) / len(zs)
        if imbalances:
            result["load_imbalance"] = sum(imbalances) / len(imbalances)
            result["load_imbalance_max"] = max(imbalances)
        return result


def _save_to_megatron_tracker(layer_number, num_layers, lb_loss, lb_coeff, z_loss, z_coeff, tokens_per_expert):
    # megatron's router saves loss / coefficient; values add up over micro-batches and
    # Megatron-LM scales them by 1 / num_microbatches when it logs
    if lb_loss is not None and lb_coeff > 0:
        _save(TRACKER_LB_LOSS, lb_loss / lb_coeff, layer_number, num_layers)
    if z_loss is not None and z_coeff > 0:
        _save(TRACKER_Z_LOSS, z_loss / z_coeff, layer_number, num_layers)
    if tokens_per_expert is not None:
        load = tokens_per_expert.detach().float()
        mean = load.mean()
        imbalance = torch.where(mean > 0, load.max() / mean.clamp(min=1e-12), torch.zeros_like(mean))
        _save(TRACKER_LOAD_IMBALANCE, imbalance, layer_number, num_layers)


def _save(name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
    values = mcore_compat.aux_loss_tracker_values().get(name)
    if values is not None and (values.numel() != num_layers or values.device != value.device):
        # left by a model of another depth (or device) in this process: megatron would index past it
        mcore_compat.drop_aux_loss_tracker_entry(name)
    save_to_aux_losses_tracker(name, value, layer_number, num_layers)


def _megatron_tracker_values():
    tracker = mcore_compat.aux_loss_tracker_values()
    return [tracker[name] for name in TRACKER_NAMES if name in tracker]


def _scalar(total: Optional[torch.Tensor], device) -> torch.Tensor:
    if total is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return total.to(device=device, dtype=torch.float64).reshape(())

