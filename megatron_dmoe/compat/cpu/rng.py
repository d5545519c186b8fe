"""megatron-core's named RNG streams (dropout regions, expert initialisation, activation
recompute) kept as CPU generator states.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1): `CudaRNGStatesTracker` seeds
and stores CUDA generator states, `model_parallel_cuda_manual_seed` fills it through them, and
activation recompute saves and restores the CUDA generator; a machine without CUDA has none. Could
go once upstream's tracker works on the default generator of the device the model is on.
"""
from __future__ import annotations

import contextlib

import torch

from megatron_dmoe.compat.cpu.devices import host_only


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Named RNG streams kept as CPU generator states (same contract as the CUDA tracker)."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def track_rng_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core.tensor_parallel import random as mcore_random

    # Activation recompute saves and restores the CUDA generator; a CPU run has none.
    mcore_random._get_cuda_rng_state = host_only(lambda *args, **kwargs: None, mcore_random._get_cuda_rng_state)
    mcore_random._set_cuda_rng_state = host_only(lambda *args, **kwargs: None, mcore_random._set_cuda_rng_state)
    _install_host_tracker()


def _install_host_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker_class()()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_rng_trackers(seed: int) -> None:
    """CPU twin of megatron's `model_parallel_cuda_manual_seed`: the same named streams and seeds,
    in a host tracker made afresh (a CUDA run before this one in the process left its own)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    _install_host_tracker()
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    offset = seed + 2718
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + ps.get_tensor_model_parallel_rank())
    expert_seed = seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank()
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)
