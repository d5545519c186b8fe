"""Checks of the state around expert parallelism, run in every process of a gloo group:
the global gradient norm, EP-independent initialisation and the checkpoint layout of the experts."""
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig

from megatron_dmoe.moe import MoELayer
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.parallel.expert_layout import ExpertLayout
from megatron_dmoe.parallel.param_roles import mark_expert_parallel
from megatron_dmoe.training.optim import CpuOptimizer
from moe_reference import make_config

HIDDEN, FFN = 8, 12


def check_global_grad_norm() -> None:
    """Dense gradients are the same on every rank, each expert gradient lives on its owner only:
    the norm counts every element once, and clipping scales both kinds by the same factor."""
    for ep, experts in ((2, 4), (4, 2)):
        init_distributed("cpu", expert_model_parallel_size=ep)
        layout = ExpertLayout(experts, FFN, ep, ps.get_expert_model_parallel_rank())
        g = torch.Generator().manual_seed(ep)
        dense_grad = torch.randn(5, HIDDEN, generator=g, dtype=torch.float64).float()
        expert_grad = torch.randn(experts, FFN, HIDDEN, generator=g, dtype=torch.float64).float()
        dense = torch.nn.Parameter(torch.zeros(5, HIDDEN))
        expert = torch.nn.Parameter(torch.zeros(layout.local_shape(HIDDEN)))
        mark_expert_parallel(expert)
        dense.grad, expert.grad = dense_grad.clone(), layout.local_slice(expert_grad).clone()
        expected = math.sqrt(dense_grad.double().square().sum().item() + expert_grad.double().square().sum().item())

        optimizer = CpuOptimizer(torch.optim.AdamW([dense, expert]), OptimizerConfig(clip_grad=expected / 4))
        norm = optimizer.clip_grad_norm(expected / 4)
        assert abs(norm - expected) < 1e-6 * expected, (ep, norm, expected)
        scale = (expected / 4) / (norm + 1e-6)
        torch.testing.assert_close(dense.grad, dense_grad * scale)
        torch.testing.assert_close(expert.grad, layout.local_slice(expert_grad) * scale)


def check_initialisation_is_ep_independent() -> None:
    """The same seed gives the same global expert weights at EP 1, 2 and 4, and the same router:
    the generator's stream after the layer is the same too."""
    config_args = dict(activation="swiglu", dtype=torch.float32)
    torch.manual_seed(7)
    single = MoELayer(make_config(HIDDEN, FFN, 2, 1, **config_args))
    after_single = torch.randn(3)
    for ep in (2, 4):
        init_distributed("cpu", expert_model_parallel_size=ep)
        torch.manual_seed(7)
        layer = MoELayer(make_config(HIDDEN, FFN, 2, 1, expert_model_parallel_size=ep, **config_args))
        assert torch.equal(torch.randn(3), after_single), ep
        assert torch.equal(layer.router.weight, single.router.weight), ep
        layout = layer.experts.layout
        for key in ("w1", "v1", "w2"):
            assert torch.equal(getattr(layer.experts, key), layout.local_slice(getattr(single.experts, key))), (ep, key)


def check_expert_checkpoint_layout() -> None:
    """ShardedTensors of the experts are indexed by global expert (and ffn shard) and written by
    exactly one replica: every element of the global tensors is covered once by replica 0."""
    for ep, experts in ((2, 4), (4, 2), (1, 4)):
        init_distributed("cpu", expert_model_parallel_size=ep)
        layer = MoELayer(make_config(HIDDEN, FFN, experts, 1, expert_model_parallel_size=ep, dtype=torch.float32))
        state = layer.sharded_state_dict(prefix="mlp.")
        w1 = state["mlp.experts.w1"]
        assert w1.key == "mlp.experts.w1" and w1.global_shape == (experts, FFN, HIDDEN), (ep, w1)
        assert w1.data is layer.experts.w1  # the optimizer maps its moments through this identity
        assert w1.replica_id == (0, 0, ps.get_expert_data_parallel_rank()), (ep, w1.replica_id)
        router = state["mlp.router.weight"]
        assert router.global_shape == (experts, HIDDEN) and router.global_offset == (0, 0)

        # every rank's (offset, local shape, replica) -> coverage of the global tensor by main replicas
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, (w1.global_offset, tuple(w1.local_shape), w1.replica_id))
        cover = torch.zeros(experts, FFN, dtype=torch.int64)
        for offset, shape, replica in shards:
            if all(r == 0 for r in replica):
                cover[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]] += 1
        assert torch.equal(cover, torch.ones_like(cover)), (ep, cover)


def check_state() -> None:
    check_global_grad_norm()
    check_initialisation_is_ep_independent()
    check_expert_checkpoint_layout()
