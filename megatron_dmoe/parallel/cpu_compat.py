"""Run megatron-core's CUDA-minded code paths on CPU.

megatron-core (0.16 through 0.19) assumes CUDA in the places our CPU runs reach: the global memory buffer
(unfused attention), DDP's gradient buffers and (0.19) their sync, the RNG tracker (dropout regions, expert
initialisation, activation recompute), the default causal mask, RoPE's frequency table, and dist_checkpointing's saver
(a device synchronisation and a status tensor). `apply_cpu_compat()` redirects exactly those to the CPU. It is
applied only when a run has no CUDA, and is idempotent; nothing else in the project patches
megatron-core.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from megatron_dmoe.compat import mcore as mcore_compat

_applied = False


@contextlib.contextmanager
def _current_device_is_cpu():
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _run_on_cpu(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    return wrapper


class _NoStream:
    """Stands in for the current CUDA stream: a CPU run has no events to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def _without_cuda_streams(method):
    """megatron-core 0.19's gradient sync asks for the current CUDA stream (to wait for graph
    replays) even when it has nothing to wait for."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        original = torch.cuda.current_stream
        torch.cuda.current_stream = lambda *a, **k: _NoStream()
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.current_stream = original

    return wrapper


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


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


def apply_cpu_compat() -> None:
    """Make megatron-core's CUDA assumptions hold on CPU (idempotent)."""
    global _applied
    if _applied:
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    mcore_utils.GlobalMemoryBuffer.get_tensor = _run_on_cpu(mcore_utils.GlobalMemoryBuffer.get_tensor)
    grad_buffer = param_and_grad_buffer._ParamAndGradBuffer
    grad_buffer.__init__ = _run_on_cpu(grad_buffer.__init__)
    bucket_group = param_and_grad_buffer._ParamAndGradBucketGroup
    bucket_group.start_grad_sync = _without_cuda_streams(bucket_group.start_grad_sync)
    writer = filesystem_async.FileSystemWriterAsync
    preload = writer.preload_tensors
    # non_blocking=False: host tensors need no device synchronisation.
    writer.preload_tensors = staticmethod(lambda buckets, non_blocking=True: preload(buckets, False))
    for home in mcore_compat.checkpoint_finalize_homes():  # where this megatron-core looks it up
        home.save_state_dict_async_finalize = _run_on_cpu(home.save_state_dict_async_finalize)
    rope = rotary_pos_embedding.RotaryEmbedding
    rope.get_emb = _run_on_cpu(rope.get_emb)
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask

    # Activation recompute saves and restores the CUDA generator; a CPU run has none.
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker_class()()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _redirect_pipeline_to_cpu()
    _redirect_optimizers_to_cpu()
    _applied = True


def seed_rng_trackers(seed: int) -> None:
    """CPU twin of megatron's `model_parallel_cuda_manual_seed`: the same named streams and seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    offset = seed + 2718
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + ps.get_tensor_model_parallel_rank())
    expert_seed = seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank()
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


def _host_device(device):
    """'cuda' (any form) -> 'cpu'; other devices as given."""
    if device is None or isinstance(device, int):
        return "cpu" if isinstance(device, int) else device
    return "cpu" if torch.device(device).type == "cuda" else device


def _made_on_host(factory):
    @functools.wraps(factory)
    def make(*args, device=None, **kwargs):
        return factory(*args, device=_host_device(device), **kwargs)

    return make


class _TorchOnCpu:
    """`torch` as seen by megatron's pipeline schedules, point-to-point code and optimizers on a
    CPU run: tensors asked for on 'cuda' are made on the CPU, the current device is the CPU, and
    device synchronisation is a no-op; everything else is torch itself."""

    class _Cuda:
        @staticmethod
        def current_device():
            return "cpu"

        @staticmethod
        def synchronize(*args, **kwargs):
            return None

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    cuda = _Cuda()
    tensor = staticmethod(_made_on_host(torch.tensor))
    zeros = staticmethod(_made_on_host(torch.zeros))
    ones = staticmethod(_made_on_host(torch.ones))
    empty = staticmethod(_made_on_host(torch.empty))

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """`tensor.cuda()` returns the tensor itself (a CPU run has no device to move to)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _redirect_pipeline_to_cpu() -> None:
    """Pipeline parallelism on gloo: megatron's schedules count tokens in a CUDA tensor, its
    point-to-point exchange allocates receive buffers on the current CUDA device and synchronises
    it, and the last stage's copy of tied embeddings is moved to CUDA before its first all-reduce."""
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    shim = _TorchOnCpu()
    schedules.torch = shim
    p2p_communication.torch = shim
    module = language_module.LanguageModule
    setup = module.setup_embeddings_and_output_layer

    @functools.wraps(setup)
    def setup_on_cpu(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return setup(self, *args, **kwargs)

    module.setup_embeddings_and_output_layer = setup_on_cpu


@contextlib.contextmanager
def _host_tensors_named_as_cuda():
    """`tensor.type()` names a host tensor as its CUDA twin ('torch.cuda.FloatTensor'): megatron's
    optimizers sort parameters by that name."""
    original = torch.Tensor.type

    def cuda_name(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _host_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's local multi_tensor_l2norm (the L2 norm of all tensors of the lists), on the host."""
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors])
    return torch.linalg.vector_norm(norms).reshape(1), None


def _redirect_optimizers_to_cpu() -> None:
    """megatron-core's optimizers on gloo (the distributed optimizer): their scale, overflow and
    norm tensors are made on 'cuda', and parameters are grouped by their CUDA type names. The
    collectives they use (reduce-scatter and all-gather into flat tensors, coalesced) exist on gloo."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer as mcore_optimizer

    shim = _TorchOnCpu()
    for module in (clip_grads, distrib_optimizer, grad_scaler, mcore_optimizer):
        module.torch = shim
    optimizer_class = distrib_optimizer.DistributedOptimizer
    build_groups = optimizer_class._build_model_and_main_param_groups.__func__  # a classmethod
    clip = clip_grads.clip_grad_by_total_norm_fp32

    @functools.wraps(build_groups)
    def build_groups_on_cpu(cls, *args, **kwargs):
        with _host_tensors_named_as_cuda():
            return build_groups(cls, *args, **kwargs)

    @functools.wraps(clip)
    def clip_on_cpu(*args, **kwargs):
        with _host_tensors_named_as_cuda():
            return clip(*args, **kwargs)

    if getattr(clip_grads, "l2_norm_impl", None) is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _host_l2_norm  # megatron's fallback returns its norm on 'cuda'
    optimizer_class._build_model_and_main_param_groups = classmethod(build_groups_on_cpu)
    gather_state = optimizer_class.get_parameter_state_dp_zero  # the reshardable checkpoint format

    @functools.wraps(gather_state)
    def gather_state_on_cpu(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return gather_state(self, *args, **kwargs)

    optimizer_class.get_parameter_state_dp_zero = gather_state_on_cpu
    set_states = optimizer_class._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_saved_states(self, model_param, tensors):
        # torch's Adam (no TE or apex) keeps its step count with each parameter's moments; the
        # reshardable checkpoint has it in the parameter groups (load_state_dict restores it from
        # there), so a per-parameter 'step' the checkpoint lacks keeps its restored value
        return set_states(self, model_param, {**self._get_main_param_and_optimizer_states(model_param), **tensors})

    optimizer_class._set_main_param_and_optimizer_states = set_saved_states
    clip_grads.clip_grad_by_total_norm_fp32 = clip_on_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_on_cpu  # imported by name there
