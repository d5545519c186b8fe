"""Adam's state created ahead of the first step (training/optim.py: init_empty_adam_states, which
captured runs call before their recording step): the same tensors torch's Adam makes itself, and
the same updates over several steps, for the fused kernel and the default loop."""
import types

import pytest
import torch

from megatron_dmoe.training.optim import init_empty_adam_states


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]


def _train(optimizer, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_made_ahead_matches_torchs_own_and_trains_alike(fused, amsgrad):
    lazy_params, ahead_params = _params(0), _params(0)
    options = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, fused=fused)
    lazy = torch.optim.AdamW(lazy_params, **options)
    ahead = torch.optim.AdamW(ahead_params, **options)
    init_empty_adam_states(types.SimpleNamespace(optimizer=ahead))  # megatron's wrapper's shape
    assert len(ahead.state) == len(ahead_params)

    _train(lazy, lazy_params, 1, seed=1)
    for p_lazy, p_ahead in zip(lazy_params, ahead_params):
        made = ahead.state[p_ahead]
        own = lazy.state[p_lazy]
        assert set(made) == set(own)
        for key in own:
            assert made[key].dtype == own[key].dtype and made[key].device == own[key].device, key
            assert made[key].shape == own[key].shape, key
        assert made["step"].item() == 0 and not made["exp_avg"].any()

    _train(ahead, ahead_params, 1, seed=1)
    _train(lazy, lazy_params, 3, seed=2)
    _train(ahead, ahead_params, 3, seed=2)
    for p_lazy, p_ahead in zip(lazy_params, ahead_params):
        assert torch.equal(p_lazy, p_ahead)
        assert torch.equal(lazy.state[p_lazy]["exp_avg_sq"], ahead.state[p_ahead]["exp_avg_sq"])
        assert lazy.state[p_lazy]["step"].item() == ahead.state[p_ahead]["step"].item() == 4


def test_existing_state_is_left_alone():
    params = _params(3)
    adam = torch.optim.AdamW(params, lr=1e-2)
    _train(adam, params, 2, seed=4)
    before = {id(p): adam.state[p]["exp_avg"].clone() for p in params}
    init_empty_adam_states(types.SimpleNamespace(optimizer=adam))
    for p in params:
        assert torch.equal(adam.state[p]["exp_avg"], before[id(p)]) and adam.state[p]["step"].item() == 2
