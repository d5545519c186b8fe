"""Gradient clipping folded into torch's fused Adam.

megatron-core clips by scaling every main gradient in place before its inner optimizer steps: one
read and one write of all fp32 gradients, a whole pass over the 3.7B of the dMoE Small whenever
the norm exceeds the clip. torch's fused Adam(W) can apply that factor itself: its `grad_scale`
(the attribute AMP's GradScaler sets) divides each gradient as the kernel reads it.

`fold_clip_into_adam(optimizer)` gives a megatron-core optimizer whose every inner optimizer is
torch's fused Adam a step that runs megatron's sequence (prepare the gradients, their global norm,
the zero count when logged, the inner steps and the copy back to the model) with the clip factor
handed over that way. Any other optimizer keeps its own step.
"""
from __future__ import annotations

import types

import torch


def _parts(optimizer) -> list:
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if not getattr(o, "is_stub_optimizer", False)]


def _is_fused_torch_adam(inner) -> bool:
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and bool(inner.param_groups) and all(
        group.get("fused") for group in inner.param_groups)


def fold_clip_into_adam(optimizer) -> bool:
    """Replace the optimizer's step as described above; False (left alone) unless it clips and every
    inner optimizer is torch's fused Adam."""
    parts = _parts(optimizer)
    if not parts or not all(_is_fused_torch_adam(getattr(o, "optimizer", None)) for o in parts):
        return False
    if not all(o.config.clip_grad > 0.0 and o.config.clip_grad == parts[0].config.clip_grad for o in parts):
        return False
    if not all(hasattr(optimizer, name) for name in ("prepare_grads", "get_grad_norm", "step_with_ready_grads")):
        return False
    optimizer.step = types.MethodType(_step, optimizer)
    return True


@torch.no_grad()
def _step(self):
    """megatron-core's step (found_inf -> no update), the clip applied by the fused Adam kernels."""
    if self.prepare_grads():
        return False, None, None
    grad_norm = self.get_grad_norm()
    parts = _parts(self)
    coefficient = parts[0].config.clip_grad / (grad_norm + 1.0e-6)  # megatron's formula
    scaled = []
    if coefficient < 1.0:
        for part in parts:
            inner = part.optimizer
            device = inner.param_groups[0]["params"][0].device
            inner.grad_scale = torch.full((), 1.0 / coefficient, dtype=torch.float32, device=device)
            scaled.append(inner)
    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    try:
        applied = self.step_with_ready_grads()
    finally:
        for inner in scaled:
            del inner.grad_scale
    return applied, grad_norm, num_zeros
