"""SDPAttention must compute what megatron-core's own (unfused) DotProductAttention computes."""
import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_dmoe.model.attention import SDPAttention


def _config(heads, groups, dtype):
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * 16,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )


def _compare(heads, groups, seq, batch, device, dtype, tol):
    config = _config(heads, groups, dtype)
    ours = SDPAttention(config, 1, AttnMaskType.causal, "self")
    theirs = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.randn(seq, batch, heads, 16, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(seq, batch, groups, 16, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(seq, batch, groups, 16, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(seq, batch, heads * 16, device=device, dtype=dtype)
    results = []
    for module in (ours, theirs):
        out = module(q, k, v, None)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out, *grads))
    for a, b in zip(*results):
        assert a.shape == b.shape
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < tol, err


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("seq,batch", [(32, 2), (17, 3)])
def test_sdpa_matches_megatron_attention_cpu(cpu_dist, heads, groups, seq, batch):
    _compare(heads, groups, seq, batch, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_sdpa_matches_megatron_attention_cuda_bf16(heads, groups):
    from megatron_dmoe.parallel.distributed import init_distributed, seed_everything

    env = init_distributed("cuda")
    seed_everything(1, env)
    _compare(heads, groups, 256, 4, "cuda", torch.bfloat16, 2e-2)
