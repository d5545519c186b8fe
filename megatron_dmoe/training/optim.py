"""Optimizer and learning-rate schedule.

CUDA: megatron-core's optimizer (fp32 master weights for bf16/fp16, loss scaling for fp16, the
distributed optimizer as an option), on torch's fused Adam with the gradient clipping folded into
it (clip_in_adam.py). CPU: the same MegatronOptimizer interface over torch's AdamW,
because megatron-core's optimizer allocates on CUDA; clipping uses the same global gradient norm
(expert gradients, sharded over expert-parallel ranks, counted once: `global_grad_norm`).
Both are driven by megatron-core's OptimizerParamScheduler.

On CUDA without apex or Transformer Engine, torch's multi-tensor kernels replace megatron-core's
per-tensor fallbacks (compat/foreach_multi_tensor.py).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_dmoe.compat.distopt_adam_step import keep_restored_adam_state
from megatron_dmoe.compat.foreach_multi_tensor import use_foreach_multi_tensor_ops
from megatron_dmoe.compat.host_grad_norm import use_float64_host_grad_norm
from megatron_dmoe.config import RunConfig
from megatron_dmoe.model.transformer_config import params_dtype
from megatron_dmoe.parallel.param_roles import is_expert_parallel
from megatron_dmoe.training.clip_in_adam import fold_clip_into_adam


def optimizer_config(cfg: RunConfig) -> OptimizerConfig:
    tr = cfg.training
    return OptimizerConfig(
        optimizer="adam",
        lr=tr.lr,
        min_lr=tr.min_lr,
        weight_decay=tr.weight_decay,
        adam_beta1=tr.adam_beta1,
        adam_beta2=tr.adam_beta2,
        adam_eps=tr.adam_eps,
        clip_grad=tr.clip_grad,
        bf16=tr.bf16,
        fp16=tr.fp16,
        params_dtype=params_dtype(cfg),
        loss_scale=tr.loss_scale,
        initial_loss_scale=tr.initial_loss_scale,
        use_distributed_optimizer=tr.use_distributed_optimizer,
    )


def _init_adam_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Create Adam's state where a parameter has none, as torch's Adam does at its first step: zero
    moments and a zero step count, on the parameter's device for the fused (or capturable) kernel."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p.data)
                state["exp_avg_sq"] = torch.zeros_like(p.data)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p.data)


def init_empty_adam_states(optimizer: MegatronOptimizer) -> None:
    """Give torch's Adam under megatron's optimizers empty moments and step counts where it has no
    state yet, exactly as its first step would. Two uses:
    - a fresh optimizer about to load a checkpoint: megatron's distributed optimizer reads the step
      count from the state of torch's Adam (without TE or apex) when it lays its checkpoint state
      out, and has none before the first step;
    - a run that captures its layers (training.cuda_graphs): the state is laid out before the
      first step. Created by that step's update instead, it would be placed around the layer inputs
      the recording step keeps until capture, and leave holes between its blocks when they go."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and not inner.state:
            _init_adam_state(inner)


def unshare_adam_steps(optimizer: MegatronOptimizer) -> None:
    """After megatron's distributed optimizer loaded a checkpoint: without TE or apex it gives every
    parameter the same step-count tensor, which torch's Adam then increments once per parameter;
    each parameter gets its own copy."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


class CpuOptimizer(FP32Optimizer):
    """megatron's FP32Optimizer without its CUDA allocations (loss scale and grad-norm buffers)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig):
        MegatronOptimizer.__init__(self, optimizer, config, _init_adam_state)
        self._scale = torch.ones(1)
        self.is_stub_optimizer = False

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = global_grad_norm(self.get_parameters())
        coefficient = clip_grad / (norm + 1e-6)
        if coefficient < 1.0:
            for p in self.get_parameters():
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        return norm


def _duplicate_group(expert: bool):
    """The ranks holding copies of a parameter that is not split over them: the tensor-parallel
    group, or for experts the expert-tensor-parallel group (with expert parallelism folded over the
    tensor group its ranks hold different experts; expert weights split over the expert-tensor group
    are marked tensor-parallel, so each shard counts)."""
    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()


def _counts_in_norm(param) -> bool:
    """megatron's filter: no shared copies, no tensor-parallel duplicates."""
    return (param.grad is not None and param_is_not_shared(param)
            and param_is_not_tensor_parallel_duplicate(param, _duplicate_group(is_expert_parallel(param))))


@torch.no_grad()
def global_grad_norm(params) -> float:
    """The L2 norm of the whole model's gradient, as if it lived on one device.

    After the data-parallel reduction every rank holds the same dense gradients (sharded only by
    tensor/pipeline parallelism) and the gradients of its own experts, which the other ranks of its
    expert-parallel group do not hold. So squares of dense gradients are summed over the
    model-parallel group and those of expert gradients (`is_expert_parallel`) over the expert
    tensor x model x pipeline group: each gradient element is counted exactly once.
    """
    params = [p for p in params if _counts_in_norm(p)]
    device = params[0].grad.device if params else torch.device("cpu")
    sums = {kind: torch.zeros(1, dtype=torch.float64, device=device) for kind in (False, True)}  # expert?
    for p in params:
        sums[is_expert_parallel(p)] += p.grad.detach().double().pow(2).sum()
    dense, expert = sums[False], sums[True]
    if dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized():
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return (dense + expert).sqrt().item()


def _param_groups(model_chunks: List[torch.nn.Module]) -> List[dict]:
    """Megatron-LM's grouping: no weight decay on biases and norm weights (1-D parameters), and
    expert-parallel parameters (`is_expert_parallel`) apart, keyed as megatron's checkpoints
    expect (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)."""
    groups = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            no_decay = p.ndim == 1 or name.endswith(".bias")
            expert = is_expert_parallel(p)
            groups.setdefault((no_decay, expert), []).append(p)
    return [
        {
            "params": params,
            "wd_mult": 0.0 if no_decay else 1.0,
            "lr_mult": 1.0,
            "is_expert_parallel": expert,
            "is_decoupled_lr": False,
        }
        for (no_decay, expert), params in sorted(groups.items())
    ]


def _fuse_torch_adam(optimizer: MegatronOptimizer) -> None:
    """Run torch's Adam(W) as its fused CUDA kernel where megatron fell back to it (no TE or apex).

    megatron builds it with torch's default multi-tensor (foreach) implementation, which makes
    several passes over the fp32 master weights and moments; the fused kernel makes one. With
    experts that is most of the optimizer step (3.7B parameters in the Small dMoE). Set before the
    first step, as the step counters are created on the device for the fused kernel.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # TE's or apex's fused Adam, or another optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(p.is_cuda and p.is_floating_point() for p in params) and not inner.state:
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True


def _expert_duplicates_by_expert_tensor_group(optimizer: MegatronOptimizer) -> None:
    """megatron-core 0.16 filters tensor-parallel duplicates out of the grad norm by the tensor group
    for every part of its chained optimizer; our expert weights are not marked tensor-parallel, so
    on tensor ranks other than 0 they would be left out, though with expert parallelism folded over
    the tensor group those ranks hold other experts, and ranks would clip by different norms. The
    expert part filters by its own group (megatron-core 0.19 does so itself: `expert_tp_group`)."""
    if not ps.model_parallel_is_initialized():
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(getattr(part, "optimizer", None), "param_groups", [])
        if groups and all(group.get("is_expert_parallel", False) for group in groups):
            part.tp_group = ps.get_expert_tensor_parallel_group()


def build_optimizer(cfg: RunConfig, model_chunks: List[torch.nn.Module], on_cuda: bool) -> MegatronOptimizer:
    config = optimizer_config(cfg)
    if config.use_distributed_optimizer:
        keep_restored_adam_state()  # its checkpoints load into torch's Adam (compat/distopt_adam_step.py)
    if not on_cuda and config.use_distributed_optimizer:
        # megatron's, on gloo through compat/cpu/; parameters sharded over the
        # data-parallel group, expert parameters over the expert-data-parallel group; its grad norm
        # summed as accurately as CpuOptimizer's (compat/host_grad_norm.py)
        use_float64_host_grad_norm()
        optimizer = get_megatron_optimizer(config, model_chunks)
        _expert_duplicates_by_expert_tensor_group(optimizer)
        return optimizer
    if on_cuda:
        use_foreach_multi_tensor_ops()
        optimizer = get_megatron_optimizer(config, model_chunks)
        _expert_duplicates_by_expert_tensor_group(optimizer)
        _fuse_torch_adam(optimizer)
        fold_clip_into_adam(optimizer)
        if cfg.training.cuda_graphs is True:
            init_empty_adam_states(optimizer)  # before the recording step (see there); a resume loads over it
        return optimizer
    adam = torch.optim.AdamW(
        _param_groups(model_chunks),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    return CpuOptimizer(adam, config)


def build_scheduler(cfg: RunConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    tr = cfg.training
    decay_iters = tr.lr_decay_iters or tr.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=tr.lr,
        min_lr=tr.min_lr,
        lr_warmup_steps=tr.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, tr.lr_warmup_iters + 1),
        lr_decay_style=tr.lr_decay_style,
        start_wd=tr.weight_decay,
        end_wd=tr.weight_decay,
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
        # a resume keeps the config's schedule, not the checkpoint's: the run directory check lets
        # only a derived decay length differ (it follows training.train_iters)
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        # WSD: the last lr_wsd_decay_iters of the decay fall from lr to min_lr in this style
        wsd_decay_steps=tr.lr_wsd_decay_iters if tr.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=tr.lr_wsd_decay_style,
    )
