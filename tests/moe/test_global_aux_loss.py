"""moe.aux_loss_type: global: expert fractions counted over the whole step."""
import pytest
import torch

from global_aux_case import (
    COEFF,
    HIDDEN,
    E,
    K,
    build_layer,
    draw_tokens,
    split_by_sequences,
    step_loss,
    whole_batch_loss,
)
from megatron_dmoe.moe import GlobalLoadBalance, load_balancing_loss


@pytest.mark.parametrize("sizes", [[6], [1, 5], [2, 2, 2], [3, 1, 2], [1, 1, 1, 1, 1, 1]])
def test_step_loss_equals_the_whole_batch_loss_for_any_split(sizes):
    layer = build_layer()
    x = draw_tokens(1, 5, 6)
    expected = whole_batch_loss(layer, x.reshape(-1, HIDDEN))
    assert abs(float(step_loss(layer, split_by_sequences(x, sizes))) - float(expected)) < 1e-12 * float(expected)
    if len(sizes) > 1:  # the micro-batches alone are balanced otherwise: the global loss differs
        first = split_by_sequences(x, sizes)[0]
        assert abs(float(whole_batch_loss(layer, first.reshape(-1, HIDDEN))) - float(expected)) > 1e-6


def test_padding_tokens_count_nowhere():
    layer = build_layer()
    x = draw_tokens(2, 5, 4)
    padding = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) < 0.4  # [b, s]
    parts, pads = split_by_sequences(x, [1, 3]), [padding[:1], padding[1:]]
    valid_tokens = x.transpose(0, 1)[~padding]  # [T valid, h]
    expected = whole_batch_loss(layer, valid_tokens)
    assert abs(float(step_loss(layer, parts, pads)) - float(expected)) < 1e-12 * float(expected)


def test_reset_starts_a_new_step_and_eval_counts_nothing():
    layer = build_layer()
    x, y = draw_tokens(3, 4, 2), draw_tokens(4, 4, 2)
    step_loss(layer, [x])
    second = step_loss(layer, [y])  # reset first: only y counts
    assert abs(float(second) - float(whole_batch_loss(layer, y.reshape(-1, HIDDEN)))) < 1e-12
    layer.eval()
    layer(x)
    assert torch.equal(layer.router.global_load.step_loss(K, COEFF), second)


def test_micro_batch_loss_uses_the_fractions_counted_so_far():
    """As megatron-core's global_aux_loss: micro-batch m's gradient-carrying loss pairs its own mean
    probabilities with the fractions of micro-batches 1..m; the first equals the micro-batch loss."""
    g = torch.Generator().manual_seed(5)
    state = GlobalLoadBalance(E)
    probs = [torch.softmax(torch.randn(n, E, generator=g, dtype=torch.float64), dim=-1) for n in (3, 5)]
    counts = [torch.randint(0, 4, (E,), generator=g) for _ in range(2)]
    first = state.loss(probs[0], counts[0], K, COEFF)
    assert torch.allclose(first, load_balancing_loss(probs[0], counts[0], K, COEFF), rtol=1e-14)
    second = state.loss(probs[1], counts[1], K, COEFF)
    fraction = (counts[0] + counts[1]).double() / (8 * K)
    assert torch.allclose(second, COEFF * E * (fraction * probs[1].mean(0)).sum(), rtol=1e-14)


def test_megatron_cores_end_of_step_reset_reaches_the_router():
    """Megatron-LM's loop resets global aux-loss state through finalize_model_grads."""
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

    layer = build_layer()
    layer(draw_tokens(6, 3, 2).requires_grad_())
    assert layer.router.global_load.sums.abs().sum() > 0
    reset_model_temporary_tensors(layer.config, [layer])
    assert layer.router.global_load.sums.abs().sum() == 0
