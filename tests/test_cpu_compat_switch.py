"""The CPU patches of megatron-core (compat/cpu/) act only while the process's run is on the host:
after `leave_host()` (what a CUDA run's start calls) every patched function is megatron-core's own
again, so a CUDA run after a CPU run in one process (an export, then a GPU evaluation) is not sent
to the host. Checked on CPU through what each kind of wrapper does with a CUDA device asked for."""
import contextlib

import pytest
import torch

from megatron_dmoe.compat.patching import patched


@pytest.fixture
def switch():
    from megatron_dmoe.compat import cpu

    cpu.apply_cpu_compat()
    yield cpu
    cpu.apply_cpu_compat()  # the rest of the session runs on the host


def test_patches_act_on_the_host_and_pass_through_after_leaving_it(switch):
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    from megatron_dmoe.compat.cpu.devices import on_host, run_on_cpu, tensor_cuda_is_identity

    current = run_on_cpu(lambda: torch.cuda.current_device())
    assert on_host()
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == "cpu"
    assert current() == "cpu"
    assert transformer_utils.get_default_causal_mask(3).device.type == "cpu"
    x = torch.ones(2)
    with tensor_cuda_is_identity():
        assert x.cuda() is x

    switch.leave_host()
    assert not on_host()
    assert schedules.torch.zeros(2, device="meta").device.type == "meta"
    if not torch.cuda.is_available():  # megatron-core's own calls: they ask for CUDA again
        with pytest.raises((RuntimeError, AssertionError)):
            schedules.torch.zeros(2, device="cuda")
        with pytest.raises((RuntimeError, AssertionError)):
            current()
        with pytest.raises((RuntimeError, AssertionError)):
            transformer_utils.get_default_causal_mask(3)
        with tensor_cuda_is_identity(), pytest.raises((RuntimeError, AssertionError)):
            x.cuda()

    switch.apply_cpu_compat()
    assert on_host() and current() == "cpu"


def test_a_cpu_run_after_another_tracker_gets_host_rng_streams(switch):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from megatron_dmoe.compat.cpu.rng import seed_rng_trackers

    mcore_random._CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()  # as a CUDA run leaves it
    with contextlib.ExitStack() as ranks:  # one process: rank 0 of every group
        for name in ("get_tensor_model_parallel_rank", "get_expert_model_parallel_rank",
                     "get_expert_tensor_parallel_rank"):
            ranks.enter_context(patched(ps, name, lambda: 0))
        seed_rng_trackers(5)
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    assert all(isinstance(s, torch.Tensor) for s in tracker.get_states().values())
