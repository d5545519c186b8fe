"""The options of test_shared_grouped_seq.py (shared experts, group-limited routing, sequence and
global aux losses) on the sparse backend in bf16 on CUDA, against the float64 per-token reference:
output and every gradient. On CPU the same check runs in fp32 through Triton's interpreter."""
import pytest
import torch

from moe_reference import draw_inputs, draw_shared, rel_err, run_layer, run_reference
from test_shared_grouped_seq import AUX, CASES, ZLOSS

# tileable by the sparse kernels (block 64) and 16-byte aligned rows in bf16
HIDDEN, FFN, SHARED_FFN, BLOCK = 64, 128, 128, 64
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: the bf16 test)")


def check_option(name, activation, device, dtype, tol):
    case, layer_options, ref_options, gate = CASES[name]
    seed = sorted(CASES).index(name) * 2 + ["gelu", "swiglu"].index(activation)
    weights = draw_inputs(case, seed, dtype, HIDDEN, FFN)
    shared = None if gate is None else draw_shared(seed, HIDDEN, SHARED_FFN, gate, dtype)
    g = torch.Generator().manual_seed(seed)
    out_grad = torch.randn(weights[0].shape, generator=g, dtype=torch.float64).to(dtype).double()
    out, grads, load = run_layer(case, activation, "sparse", False, weights, out_grad, dtype, aux=AUX, z=ZLOSS,
                                 device=device, shared=shared, block_size=BLOCK, **layer_options)
    ref_out, ref_grads, chosen = run_reference(case, activation, weights, out_grad, aux=AUX, z=ZLOSS,
                                               shared=shared, **ref_options)
    assert [sum(e in c for c in chosen) for e in range(case["E"])] == load
    assert rel_err(out.cpu(), ref_out) < tol
    for key, ref in ref_grads.items():
        if ref is not None:
            assert rel_err(grads[key].cpu(), ref) < tol, key


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
def test_option_in_bf16_on_cuda_matches_reference(name, activation):
    check_option(name, activation, "cuda", torch.bfloat16, 2e-2)


@interpreter_only
@pytest.mark.parametrize("name", ["everything", "shared-gate", "global-aux-one-micro-batch"])
@pytest.mark.slow
def test_option_on_the_sparse_kernels_through_the_interpreter(name):
    check_option(name, "swiglu", "cpu", torch.float32, 1e-4)
