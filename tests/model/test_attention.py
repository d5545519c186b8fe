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
@pytest.mark.slow
def test_sdpa_matches_megatron_attention_cpu(cpu_dist, heads, groups, seq, batch):
    _compare(heads, groups, seq, batch, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_sdpa_matches_megatron_attention_cuda_bf16(heads, groups):
    from megatron_dmoe.parallel.distributed import init_distributed, seed_everything

    env = init_distributed("cuda")
    seed_everything(1, env)
    _compare(heads, groups, 256, 4, "cuda", torch.bfloat16, 2e-2)


def _saved_bytes(fn):
    """Bytes autograd keeps for backward while `fn` runs (what activation memory a forward costs)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(sizes)


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2)])
@pytest.mark.slow
def test_selective_recompute_gives_the_same_values_and_gradients_and_keeps_only_the_inputs(cpu_dist, heads, groups):
    """training.recompute_granularity: selective on the SDPA core attention: its own non-reentrant
    checkpoint, which torch.autograd.grad (how megatron captures a layer's backward) can go through,
    unlike megatron's reentrant one."""
    config = _config(heads, groups, torch.float64)
    plain = SDPAttention(config, 1, AttnMaskType.causal, "self")
    recomputed = SDPAttention(config, 1, AttnMaskType.causal, "self", recompute=True)
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    q, k, v = (torch.randn(40, 3, n, 16, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (heads, groups, groups))
    grad_out = torch.randn(40, 3, heads * 16, generator=gen, dtype=torch.float64)
    results, saved = [], []
    for module in (plain, recomputed):
        out, kept = _saved_bytes(lambda: module(q, k, v, None))
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
        saved.append(kept)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    assert saved[1] <= inputs < saved[0]  # the kernel's own saved tensors (and GQA's copies) are gone
    with torch.no_grad():  # evaluation: no checkpoint
        torch.testing.assert_close(recomputed(q, k, v, None), results[0][0])


def test_recompute_refuses_attention_dropout():
    config = _config(4, 4, torch.float32)
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        SDPAttention(config, 1, AttnMaskType.causal, "self", recompute=True)
