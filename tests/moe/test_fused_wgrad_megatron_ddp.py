"""megatron-core's DistributedDataParallel around the sparse layer (test_fused_wgrad.py's
convention as megatron-core's DDP reads it): the expert weights' fp32 main_grad after two
micro-batches. On CPU the kernels run through Triton's interpreter."""
import pytest
import torch

from moe_reference import make_config
from test_fused_wgrad import BS, FFN, HIDDEN, E, K, _rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.slow
def test_megatron_ddp_accumulates_two_micro_batches(cpu_dist, dtype):
    """megatron-core's DDP (fp32 grad buffers) around the layer: after two micro-batches, the expert
    weights' main_grad is the sum of the two reference gradients, added by the kernels alone."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dmoe.moe import MoELayer

    config = make_config(HIDDEN, FFN, E, K, activation="swiglu", dtype=torch.float32)
    layer = MoELayer(config, backend="sparse", block_size=BS).to(dtype)
    reference = MoELayer(config, backend="sparse", block_size=BS).to(dtype)
    reference.load_state_dict(layer.state_dict())
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=layer,
    )
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8, 3, HIDDEN, generator=g).to(dtype), torch.randn(8, 3, HIDDEN, generator=g).to(dtype))
               for _ in range(2)]

    expected = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in reference.named_parameters()}
    for x, dy in batches:
        reference.zero_grad(set_to_none=True)
        out, _ = reference(x)
        out.backward(dy)
        for name, p in reference.named_parameters():
            expected[name] += p.grad.double()

    ddp.zero_grad_buffer()
    experts = dict(layer.experts.named_parameters())
    for x, dy in batches:
        out, _ = ddp(x)
        out.backward(dy)
        for name, p in experts.items():
            assert p.grad_added_to_main_grad and p.grad is None, name  # DDP's hook dropped the placeholder
    ddp.finish_grad_sync()

    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for name, p in layer.named_parameters():
        assert p.main_grad.dtype == torch.float32
        assert _rel(p.main_grad, expected[name]) < tol, name
    ddp.zero_grad_buffer()
    assert all(not p.grad_added_to_main_grad for p in experts.values())
