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


def _distopt_checkpoint_state_is_each_parameters_own() -> None:
    """The distributed optimizer's reshardable checkpoint state over a buffer of several buckets
    whose ends are padded: after an Adam step, each parameter's saved main weight is that parameter
    (megatron-core packs the buckets without their end padding, then slices at padded offsets)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dmoe.compat.cpu import apply_cpu_compat
    from megatron_dmoe.training.checkpoint import _optimizer_metadata

    apply_cpu_compat()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            # 27, 99, 117 and 63 elements with biases: no bucket ends on the 128-element padding
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, n) for n in (3, 11, 13, 7))

        def forward(self, x):
            return sum(layer(x).sum() for layer in self.layers)

    torch.manual_seed(0)
    # megatron-core splits a buffer into buckets of `bucket_size` only when gradients are reduced in
    # overlap with backward (training splits off the tied embedding's bucket under pipelines)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=True, bucket_size=40)
    model = DistributedDataParallel(config, ddp_config, Tiny())
    assert len(model.buffers[0].buckets) > 1
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True),
                                       [model])
    model.zero_grad_buffer()
    model(torch.randn(5, 8)).backward()
    model.finish_grad_sync()
    optimizer.step()
    model_sd = model.module.sharded_state_dict()
    state = optimizer.sharded_state_dict(model_sd, metadata=_optimizer_metadata(optimizer))
    saved = {t.key: t.data for t in state["param_state"].values() for t in t.values()}
    for name, param in model.module.named_parameters():
        assert torch.equal(saved[f"optimizer.state.param.{name}"], param.detach()), name


def patched_internals() -> None:
    _grad_sync_matches_float64()
    _checkpoint_round_trip_without_helper_processes()
    _distopt_checkpoint_state_is_each_parameters_own()
