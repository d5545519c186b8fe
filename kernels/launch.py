"""What every kernel launch of the library shares: can it run here, how many programs, which dot
precision, can TMA read an operand, and which device backward launches on.

Imports torch only (triton lazily), so any module of the library, and megatron_dmoe's own Triton
code, can use it without importing the products.
"""
from __future__ import annotations

import functools

import torch


def interpreted(kernel) -> bool:
    """Was the kernel made under TRITON_INTERPRET=1 (it then runs on CPU tensors)?"""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel, device: torch.device) -> None:
    if device.type == "cpu" and not interpreted(kernel):
        raise RuntimeError(
            "the Triton kernels need CUDA tensors; to run them on CPU tensors set TRITON_INTERPRET=1 "
            "before triton is first imported, or use dmoe_kernels.reference "
            "(and Topology.for_experts(..., builder='torch'))"
        )


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """Grid size of a persistent kernel: per_sm programs per multiprocessor of the device."""
    if device.type != "cuda":
        return 3  # the interpreter: a few programs still exercise the persistent loop
    return multiprocessors(device) * per_sm


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    if dtype == torch.float32 and device.type == "cuda" and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"  # match torch.matmul's full fp32 precision unless the user allowed tf32
    return "tf32"  # ignored for 16-bit operands


def tma_ready(t: torch.Tensor, transposed: bool = False) -> bool:
    """Can a TMA descriptor read t (row-major 2-D, or the transpose of one when transposed)?"""
    outer, inner = (t.stride(1), t.stride(0)) if transposed else (t.stride(0), t.stride(1))
    width = t.shape[0] if transposed else t.shape[1]
    return (
        inner == 1
        and outer >= width  # a plain row-major layout (no broadcast rows)
        and (outer * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def tma_descriptor(t: torch.Tensor, block_shape):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape))


def bind_device(t: torch.Tensor) -> None:
    """Make the tensor's CUDA context current on this thread.

    Backward runs on autograd's worker thread; when its first CUDA call is a Triton launch that
    builds TMA descriptors, no context is bound yet ("invalid device context"). set_device is cheap.
    """
    if t.is_cuda:
        torch.cuda.set_device(t.device)
