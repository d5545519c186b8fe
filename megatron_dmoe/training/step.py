"""One training step and evaluation through megatron-core's forward-backward schedules.

As Megatron-LM's pretrain_gpt.py: a forward-step function and a loss function handed to
`get_forward_backward_func()`, which picks the schedule for the layout (no pipelining, 1F1B over
pipeline stages, or the interleaved schedule over several model chunks per stage). The schedule
divides each micro-batch's loss by the number of micro-batches, multiplies it by the fp16 loss
scale (`config.grad_scale_func`), and sets the MoE aux losses' gradient scale to the same factor
(MoEAuxLossAutoScaler, which our AuxLossScaler reads). Only the last pipeline stage computes the
loss: the values returned here are reduced so that every rank reports it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_dmoe.moe.global_aux_loss import reset_global_load_balance
from megatron_dmoe.moe.run_state import MoERunState
from megatron_dmoe.training.cuda_graphs import (
    FirstStepMemory,
    capture_after_schedule,
    capture_layer_graphs,
    eager_layers,
    layer_graphs_pending,
)

Chunks = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _chunks(model: Chunks) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def masked_mean_loss(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """The schedule's loss function: mean next-token loss over the unmasked tokens, and that value
    (a copy: the schedule divides the returned loss in place) for reporting."""
    mask = loss_mask.float()
    loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"loss": loss.detach().clone()}


def forward_step(data: Iterator[dict], model):
    """The schedule's forward-step function. Every stage reads the micro-batch: the first takes its
    tokens (later stages get their input from the previous stage), the last its labels and mask."""
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(masked_mean_loss, batch["loss_mask"])


def _run_schedule(chunks: List[torch.nn.Module], data: Iterator[dict], num_micro_batches: int,
                  device: torch.device, forward_only: bool) -> List[torch.Tensor]:
    """One global batch's micro-batches through the layout's schedule; the losses on the last
    stage (an empty list elsewhere). Each model chunk reads the same micro-batches."""
    batches = [_to_device(next(data), device) for _ in range(num_micro_batches)]
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_micro_batches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return [out["loss"] for out in outputs]


def _mean_on_every_stage(losses: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The mean of the last stage's losses, on every pipeline stage (summed over the pipeline group,
    where the other stages contribute zero); no collective without pipeline parallelism."""
    value = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        value = value.float().clone()
        dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    return value


def train_step(model: Chunks, optimizer, data: Iterator[dict], num_micro_batches: int, device: torch.device,
               run_state: MoERunState, expert_wgrad_per_step: bool = False, graphs_must_fit: bool = False):
    """Forward/backward over the micro-batches, reduce gradients, step the optimizer.

    model: the DDP-wrapped model, or its chunks (one per virtual pipeline stage).
    run_state: the MoE state the model's layers share (moe/run_state.py).
    expert_wgrad_per_step: the sparse experts' weight gradients are computed once, after the last
    backward, over all micro-batches (moe.expert_wgrad_per_step; see moe/experts/per_step_wgrad.py).
    graphs_must_fit: captured layers whose memory pool would not fit beside the next step run eagerly
    instead (training.cuda_graphs: auto; see cuda_graphs.capture_layer_graphs).
    Returns (mean loss as a device tensor, on every rank of the pipeline, grad norm or None,
    whether the update was applied).
    """
    chunks = _chunks(model)
    start = torch.cuda.memory_allocated() if graphs_must_fit else 0  # before the step's activations
    for chunk in chunks:
        chunk.zero_grad_buffer()
    run_state.wgrad.main_grads_zeroed()  # the sparse experts' first gradients may overwrite them
    optimizer.zero_grad()
    reset_global_load_balance(chunks)  # moe.aux_loss_type global: expert fractions count this step only
    config = get_model_config(chunks[0])
    # Megatron-LM's hook: the loss (and through the schedule the aux losses) times the fp16 scale
    config.grad_scale_func = optimizer.scale_loss
    with capture_after_schedule(chunks), \
            run_state.wgrad.per_step(enabled=expert_wgrad_per_step and num_micro_batches > 1):
        losses = _run_schedule(chunks, data, num_micro_batches, device, forward_only=False)
    finalize_model_grads(chunks)  # data-parallel reduction, tied embeddings across the pipeline
    first_step = FirstStepMemory(start) if graphs_must_fit and layer_graphs_pending() else None
    applied, grad_norm, _ = optimizer.step()
    # with training.cuda_graphs, after the first step, once the optimizer's state exists
    capture_layer_graphs(chunks, run_state.metrics, first_step)
    return _mean_on_every_stage(losses, device), grad_norm, applied


@torch.no_grad()
def evaluate(model: Chunks, data: Iterator[dict], num_batches: int, num_micro_batches: int,
             device: torch.device) -> float:
    """Mean loss over `num_batches` global batches, averaged over data-parallel ranks."""
    chunks = _chunks(model)
    for chunk in chunks:
        chunk.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(capture_after_schedule(chunks))  # nothing to capture from evaluation
        for chunk in chunks:
            stack.enter_context(eager_layers(chunk))
        for _ in range(num_batches):
            losses = _run_schedule(chunks, data, num_micro_batches, device, forward_only=True)
            total += _mean_on_every_stage(losses, device).double()
    for chunk in chunks:
        chunk.train()
    total /= num_batches
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total.item() / ps.get_data_parallel_world_size()


def mean_over_data_parallel(value: torch.Tensor) -> float:
    value = value.detach().double().reshape(1).clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()
