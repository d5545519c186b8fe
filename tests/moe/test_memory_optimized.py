"""Memory-optimised experts keep only the expert input and pre-activation(s) for backward."""
import pytest
import torch

from megatron_dmoe.moe import MoELayer
from moe_reference import make_config


def saved_ffn_tensors(layer, x, ffn):
    """Number of tensors saved for backward whose last dimension is the expert width."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out, _ = layer(x)
    out.sum().backward()
    return sum(1 for shape in saved if len(shape) == 2 and shape[-1] == ffn)


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("activation,plain,optimized", [("gelu", 2, 1), ("swiglu", 3, 2)])
def test_activation_is_not_kept_when_memory_optimized(activation, plain, optimized, backend):
    ffn = 20
    config = make_config(12, ffn, 4, 2, activation=activation, dtype=torch.float32)
    x = torch.randn(7, 2, 12)
    counts = {}
    for mode in (False, True):
        layer = MoELayer(config, backend=backend, memory_optimized=mode)
        layer.train()
        counts[mode] = saved_ffn_tensors(layer, x, ffn)
    # plain keeps pre-activation(s) and the activation; optimised only the pre-activation(s)
    assert counts == {False: plain, True: optimized}
