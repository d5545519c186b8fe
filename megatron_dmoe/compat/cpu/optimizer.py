"""megatron-core's optimizers (the distributed optimizer included) on gloo.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1): the grad scaler, the gradient
clip and the optimizers make their scale, overflow and norm tensors on 'cuda'; the distributed
optimizer groups parameters by their CUDA type names (`tensor.type()`) and moves gathered
checkpoint state with `.cuda()`; megatron's fallback multi-tensor L2 norm returns its norm on
'cuda'. The collectives they use (reduce-scatter and all-gather into flat tensors, coalesced)
exist on gloo. Could go once upstream makes those tensors on the parameters' device and groups
parameters by dtype rather than by type name.

"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from megatron_dmoe.compat.cpu.devices import TorchOnCpu, host_only, on_host, tensor_cuda_is_identity
from megatron_dmoe.compat.patching import patched


@contextlib.contextmanager
def _host_tensors_named_as_cuda() -> Iterator[None]:
    """`tensor.type()` names a host tensor as its CUDA twin ('torch.cuda.FloatTensor'): megatron's
    optimizers sort parameters by that name."""
    if not on_host():
        yield
        return
    original = torch.Tensor.type

    def cuda_name(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    with patched(torch.Tensor, "type", cuda_name):
        yield


def _host_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's local multi_tensor_l2norm (the L2 norm of all tensors of the lists), on the host."""
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors])
    return torch.linalg.vector_norm(norms).reshape(1), None


def optimizers_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer as mcore_optimizer

    shim = TorchOnCpu()
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
        # megatron's fallback returns its norm on 'cuda'
        clip_grads.l2_norm_impl = host_only(_host_l2_norm, clip_grads.l2_norm_impl)
    optimizer_class._build_model_and_main_param_groups = classmethod(build_groups_on_cpu)
    gather_state = optimizer_class.get_parameter_state_dp_zero  # the reshardable checkpoint format

    @functools.wraps(gather_state)
    def gather_state_on_cpu(self, *args, **kwargs):
        with tensor_cuda_is_identity():
            return gather_state(self, *args, **kwargs)

    optimizer_class.get_parameter_state_dp_zero = gather_state_on_cpu
    clip_grads.clip_grad_by_total_norm_fp32 = clip_on_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_on_cpu  # imported by name there
