"""Wrap freshly built model chunks for training: 16-bit wrapper where asked, then megatron's DDP."""
from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from megatron_dmoe.parallel.param_roles import set_main_grad_only


def _wrap_chunk(model, use_distributed_optimizer: bool, first: bool) -> DistributedDataParallel:
    if model.config.bf16 or model.config.fp16:
        # Megatron-LM's wrapper: 16-bit parameters, fp32 inputs cast on the way in, logits back to fp32.
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    # as Megatron-LM's get_model: only the first chunk's buffers are split into buckets
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                  disable_bucketing=not first)
    # Gradients are reduced from the whole buffer after backward (no overlap), so no parameter needs
    # its backward hook to fire: kernels may add weight gradients into main_grad outside autograd
    # (the sparse experts do; see moe/experts/sparse.py).
    for param in ddp.module.parameters():
        set_main_grad_only(param, not ddp_config.overlap_grad_reduce)
    return ddp


def wrap_for_training(model, use_distributed_optimizer: bool = False):
    """`model`: one module (returns its wrapper) or a list of chunks (returns a list of wrappers)."""
    if isinstance(model, list):
        return [_wrap_chunk(chunk, use_distributed_optimizer, first=i == 0) for i, chunk in enumerate(model)]
    return _wrap_chunk(model, use_distributed_optimizer, first=True)
