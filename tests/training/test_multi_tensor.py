"""The foreach replacements of megatron-core's multi-tensor fallbacks against plain torch."""
import pytest
import torch

from megatron_dmoe.compat.foreach_multi_tensor import foreach_l2_norm, foreach_scale, use_foreach_multi_tensor_ops


def _tensors(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = ((7, 5), (13,), (3, 4, 2), (1,))
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def test_l2_norm_is_the_norm_of_all_tensors_as_one_vector():
    tensors = _tensors(0)
    norm, per_tensor = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [tensors], False)
    expected = torch.cat([t.double().reshape(-1) for t in tensors]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    empty, _ = foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [[]], False)
    assert empty.item() == 0.0


@pytest.mark.parametrize("scale", [1.0, 0.37, torch.tensor(0.25)])
def test_scale_copies_across_dtypes_and_scales_in_place(scale):
    src = _tensors(1)
    dst = [torch.full_like(t, 9.0, dtype=torch.bfloat16) for t in src]
    foreach_scale(2048, None, [src, dst], scale)
    for s, d in zip(src, dst):
        assert torch.equal(d, (s * scale).to(torch.bfloat16))
    grads = _tensors(2)
    expected = [g * scale for g in grads]
    foreach_scale(2048, None, [grads, grads], scale)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, rtol=1e-6, atol=0)


def test_installed_over_megatron_fallbacks():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    before = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl)
    if before[0] not in (utils.local_multi_tensor_l2_norm, foreach_l2_norm):
        pytest.skip("apex or Transformer Engine provides megatron's multi-tensor kernels here")
    try:
        use_foreach_multi_tensor_ops()
        assert clip_grads.l2_norm_impl is foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is foreach_scale
        assert optimizer.multi_tensor_scale_impl is foreach_scale
    finally:
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl = before
