"""Checks of megatron_dmoe's patches of megatron-core internals, run in one spawned CPU process
(see test_mcore_compat.py): each fails on the release whose internals the patch no longer fits."""
import os
import tempfile

import torch


def _grad_sync_matches_float64() -> None:
    """megatron's DDP on CPU: backward fills the gradient buffer and finalize_model_grads runs the
    bucket sync (0.19 asks for a CUDA stream there); main_grad equals a float64 dense gradient."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.linear(x)

    torch.manual_seed(0)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), Tiny())
    x, target = torch.randn(5, 8), torch.randn(5, 3)
    model.zero_grad_buffer()
    ((model(x) - target) ** 2).sum().backward()
    finalize_model_grads([model])

    weight = model.module.linear.weight.detach().double().requires_grad_()
    bias = model.module.linear.bias.detach().double().requires_grad_()
    ((x.double() @ weight.T + bias - target.double()) ** 2).sum().backward()
    torch.testing.assert_close(model.module.linear.weight.main_grad.double(), weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.module.linear.bias.main_grad.double(), bias.grad, rtol=1e-5, atol=1e-6)


def _checkpoint_round_trip_without_helper_processes() -> None:
    """InProcessSaveStrategy on CPU: the save finishes (its finalize step runs on the CPU), starts
    no process (megatron's writer would start a multiprocessing Manager), and loads back exactly."""
    import psutil
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_dmoe.training.checkpoint_writer import InProcessSaveStrategy

    torch.manual_seed(1)
    saved = {"a": torch.randn(4, 6, dtype=torch.float64), "b": torch.randn(7)}
    with tempfile.TemporaryDirectory() as folder:
        dist_checkpointing.save(
            {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in saved.items()},
            folder, sharded_strategy=InProcessSaveStrategy())
        children = psutil.Process(os.getpid()).children(recursive=True)
        assert not children, f"the save left processes behind: {children}"
        loaded = dist_checkpointing.load(
            {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=0) for k, v in saved.items()},
            folder)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def patched_internals() -> None:
    _grad_sync_matches_float64()
    _checkpoint_round_trip_without_helper_processes()
