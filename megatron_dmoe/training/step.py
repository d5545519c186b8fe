"""One training step (micro-batches accumulated into the global batch) and evaluation."""
from __future__ import annotations

from typing import Iterator, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads

from megatron_dmoe.moe.aux_loss import set_aux_loss_scale
from megatron_dmoe.moe.global_aux_loss import reset_global_load_balance
from megatron_dmoe.moe.run_state import MoERunState
from megatron_dmoe.training.cuda_graphs import capture_layer_graphs, eager_layers


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def micro_batch_loss(model, batch: dict) -> torch.Tensor:
    """Mean next-token loss over the micro-batch's unmasked tokens."""
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)


def train_step(model, optimizer, data: Iterator[dict], num_micro_batches: int, device: torch.device,
               run_state: MoERunState, expert_wgrad_per_step: bool = False):
    """Forward/backward over the micro-batches, reduce gradients, step the optimizer.

    run_state: the MoE state the model's layers share (moe/run_state.py).
    expert_wgrad_per_step: the sparse experts' weight gradients are computed once, after the last
    backward, over all micro-batches (moe.expert_wgrad_per_step; see moe/experts/per_step_wgrad.py).
    Returns (mean loss on this rank as a device tensor, grad norm or None, whether the update was applied).
    """
    model.zero_grad_buffer()
    run_state.wgrad.main_grads_zeroed()  # the sparse experts' first gradients may overwrite them
    optimizer.zero_grad()
    reset_global_load_balance(model)  # moe.aux_loss_type global: expert fractions count this step only
    loss_scale = optimizer.get_loss_scale().to(device)
    losses: List[torch.Tensor] = []
    with run_state.wgrad.per_step(enabled=expert_wgrad_per_step and num_micro_batches > 1):
        for _ in range(num_micro_batches):
            batch = _to_device(next(data), device)
            loss = micro_batch_loss(model, batch)
            # as megatron-core's schedule does after each forward: aux losses get their gradient at
            # the LM loss's scale (the fp16 loss scale over the number of micro-batches)
            set_aux_loss_scale(loss_scale, num_micro_batches)
            optimizer.scale_loss(loss / num_micro_batches).backward()
            losses.append(loss.detach())
    capture_layer_graphs(model, run_state.metrics)  # after the first step, with training.cuda_graphs
    finalize_model_grads([model])
    applied, grad_norm, _ = optimizer.step()
    return torch.stack(losses).mean(), grad_norm, applied


@torch.no_grad()
def evaluate(model, data: Iterator[dict], num_batches: int, num_micro_batches: int, device: torch.device) -> float:
    """Mean loss over `num_batches` global batches, averaged over data-parallel ranks."""
    model.eval()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    with eager_layers(model):
        for _ in range(num_batches * num_micro_batches):
            total += micro_batch_loss(model, _to_device(next(data), device)).double()
    model.train()
    total /= num_batches * num_micro_batches
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total.item() / ps.get_data_parallel_world_size()


def mean_over_data_parallel(value: torch.Tensor) -> float:
    value = value.detach().double().reshape(1).clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()
