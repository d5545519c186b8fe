"""The MoE layer's execution path: one object chosen when the layer is built, again only when its
weights move to another dtype or device, never per call; a cast layer still matches the float64
per-token reference."""
import pytest
import torch

from megatron_dmoe.moe import MoELayer
from megatron_dmoe.moe.paths.base import UnavailablePath
from megatron_dmoe.moe.paths.capacity import CapacityPath
from megatron_dmoe.moe.paths.local_dropless import LocalDroplessPath
from megatron_dmoe.moe.paths.local_sparse import LocalSparsePath
from moe_reference import draw_inputs, load_weights, make_config, rel_err, run_reference

H, F, E, K = 16, 32, 4, 2


def _layer(dtype=torch.float32, **kwargs):
    return MoELayer(make_config(H, F, E, K, dtype=dtype), block_size=16, **kwargs)


@pytest.mark.parametrize("kwargs, path, backend", [
    ({"backend": "reference"}, LocalDroplessPath, "reference"),
    ({"backend": "auto"}, LocalDroplessPath, "reference"),  # auto keeps the kernels for accelerators
    ({"backend": "sparse"}, LocalSparsePath, None),  # under Triton's interpreter on CPU
    ({"backend": "reference", "capacity_factor": 1.0}, CapacityPath, None),
])
def test_path_is_chosen_when_the_layer_is_built(kwargs, path, backend):
    layer = _layer(**kwargs)
    assert type(layer.path) is path
    if backend is not None:
        assert layer.path.backend.name == backend
    chosen = layer.path
    x = torch.randn(3, 2, H)
    layer(x)
    layer(x)
    assert layer.path is chosen  # not rebuilt, not swapped by a forward


def test_path_follows_the_weights_dtype():
    """The sparse kernels take no float64: cast there, the layer still builds and its forward says
    why it cannot run; cast back, the sparse path returns."""
    layer = _layer(backend="sparse")
    assert type(layer.path) is LocalSparsePath
    layer.double()
    assert isinstance(layer.path, UnavailablePath)
    with pytest.raises(ValueError, match="backend'='sparse' cannot run here.*float64"):
        layer(torch.randn(3, 2, H, dtype=torch.float64))
    layer.float()
    assert type(layer.path) is LocalSparsePath
    assert layer(torch.randn(3, 2, H))[0].shape == (3, 2, H)


def test_a_layer_cast_to_float64_matches_the_reference():
    """Built in fp32 and cast with .double() (as a mixed-precision wrapper casts), the re-chosen
    path computes in float64: output and every gradient against the per-token loop reference."""
    case = dict(s=5, b=3, E=E, k=K, score="softmax", pre=True, renorm=False, scale=1.0, dead=[1])
    weights = draw_inputs(case, 11, torch.float64, H, F)
    out_grad = torch.randn(case["s"] * case["b"], H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    layer = _layer(backend="auto").double()
    assert layer.path.backend.name == "reference" and layer.experts.w1.dtype == torch.float64
    x, router_w, w1, v1, w2 = weights
    load_weights(layer, router_w, w1, v1, w2)
    x_in = x.clone().view(case["s"], case["b"], H).requires_grad_()
    out, _ = layer(x_in)
    (out * out_grad.view_as(out)).sum().backward()
    ref_out, ref_grads, _ = run_reference(case, "gelu", weights, out_grad)
    assert rel_err(out.reshape(-1, H), ref_out) < 1e-10
    grads = dict(x=x_in.grad.reshape(-1, H), router=layer.router.weight.grad, w1=layer.experts.w1.grad,
                 w2=layer.experts.w2.grad)
    for key, grad in grads.items():
        assert rel_err(grad, ref_grads[key]) < 1e-10, key
