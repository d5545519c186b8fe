"""The checkpoint's RNG streams move between a captured run's tracker (graph-safe generators, which
its CUDA graphs register by identity) and an eager run's (state tensors), either way. On CPU with
CPU generators standing in for the CUDA ones: the same torch.Generator interface."""
import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from megatron_dmoe.training.checkpoint import portable_tracker_states, restore_tracker_states


def _generator(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def _draw(state):
    gen = state if isinstance(state, torch.Generator) else torch.Generator().set_state(state)
    return torch.rand(4, generator=gen)


def test_saved_states_are_tensors_and_restore_into_generators_kept_by_identity():
    saving = CudaRNGStatesTracker()
    saving.set_states({"model-parallel-rng": _generator(1), "expert-parallel-rng": _generator(2)})
    _draw(saving.get_states()["model-parallel-rng"])  # the stream moved on before the save
    saved = portable_tracker_states(saving.get_states())
    assert all(isinstance(s, torch.Tensor) for s in saved.values())
    expected = {name: _draw(state.clone()) for name, state in saved.items()}

    captured = CudaRNGStatesTracker()  # a resumed captured run: its own generators, seeded afresh
    mine = {"model-parallel-rng": _generator(7), "expert-parallel-rng": _generator(8)}
    captured.set_states(dict(mine))
    restore_tracker_states(captured, saved)
    for name, gen in captured.get_states().items():
        assert gen is mine[name]
        assert torch.equal(_draw(gen), expected[name])


def test_generator_states_restore_into_an_eager_tracker_as_tensors():
    saved = {"model-parallel-rng": _generator(3)}  # a checkpoint that kept the generator itself
    expected = _draw(_generator(3))
    eager = CudaRNGStatesTracker()
    eager.set_states({"model-parallel-rng": _generator(9).get_state()})
    restore_tracker_states(eager, saved)
    state = eager.get_states()["model-parallel-rng"]
    assert isinstance(state, torch.Tensor)
    assert torch.equal(_draw(state), expected)
