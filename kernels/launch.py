"""What every kernel launch of the library shares: can it run here, how many programs, which dot
precision, which Triton element type, can TMA read an operand, which device backward launches on, and the launch itself
(`DirectLauncher`: Triton's launch without its per-call argument binding).

Imports torch only (triton lazily), so any module of the library, and megatron_dmoe's own Triton
code, can use it without importing the products.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

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


# multiprocessors the persistent kernels leave free (leave_multiprocessors_free)
_left_free = [0]


@contextlib.contextmanager
def leave_multiprocessors_free(count: int):
    """Persistent kernels launched (or captured) inside size their grids for all but `count`
    multiprocessors, so that kernels on other streams (an exchange's pushes) find room beside
    them instead of waiting for the whole product to end. At least one is always used."""
    if count < 0:
        raise ValueError(f"leave_multiprocessors_free: count must be >= 0, got {count}")
    previous, _left_free[0] = _left_free[0], count
    try:
        yield
    finally:
        _left_free[0] = previous


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """Grid size of a persistent kernel: per_sm programs per multiprocessor of the device, less the
    multiprocessors left free (leave_multiprocessors_free)."""
    if device.type != "cuda":
        return 3  # the interpreter: a few programs still exercise the persistent loop
    return max(1, multiprocessors(device) - _left_free[0]) * per_sm


@functools.lru_cache(maxsize=None)  # called at every launch: a lookup after the first
def triton_dtype(dtype: torch.dtype):
    """Triton's element type of a float torch dtype: a kernel's OUT_DTYPE constexpr."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


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
        # torch.compile traces without pointers (tools/bench_compiled_launch.py); eager reads it
        and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0)
    )


@functools.lru_cache(maxsize=None)
def _descriptor_type():
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    defaults = {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}
    return TensorDescriptor, defaults


def tma_descriptor(t: torch.Tensor, block_shape):
    """Triton's host-side TensorDescriptor of t. Its constructor validates alignment, strides and
    the block shape in Python on every call; callers have checked `tma_ready(t)` and pass fixed
    power-of-two blocks, so the fields are set directly (the constructor still runs for an empty t,
    whose error it reports)."""
    if torch.compiler.is_compiling():  # the one constructor dynamo traces into a graph
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor.from_tensor(t, list(block_shape))
    kind, defaults = _descriptor_type()
    shape = list(t.shape)
    if 0 in shape:
        return kind(t, shape, list(t.stride()), list(block_shape))
    desc = object.__new__(kind)
    for name, value in defaults.items():
        setattr(desc, name, value)
    desc.base, desc.shape, desc.strides, desc.block_shape = t, shape, list(t.stride()), list(block_shape)
    return desc


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints (triton.cdiv is a constexpr function, several times slower to call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1, and 0 for 0, as triton.next_power_of_2 (host ints)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def bind_device(t: torch.Tensor) -> None:
    """Make the tensor's CUDA context current on this thread.

    Backward runs on autograd's worker thread; when its first CUDA call is a Triton launch that
    builds TMA descriptors, no context is bound yet ("invalid device context"). set_device is cheap.
    """
    if t.is_cuda and not torch.compiler.is_compiling():  # dynamo cannot trace set_device
        torch.cuda.set_device(t.device)


_NO_DEFAULT = inspect.Parameter.empty


def _specialization(value):
    """What Triton specialises a non-constexpr argument on: dtype and 16-byte alignment of tensors,
    an int's width and whether it is 1 or a multiple of 16, a descriptor's dtype and block, else type."""
    kind = type(value)
    if kind is torch.Tensor:  # most arguments: tested first
        return (value.dtype, value.data_ptr() % 16 == 0)
    if kind is int:
        return (kind, value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
    if kind is bool or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if kind is float:
        return kind
    base = getattr(value, "base", None)  # triton.tools.tensor_descriptor.TensorDescriptor
    if isinstance(base, torch.Tensor):
        options = (getattr(value, "padding", None), getattr(value, "round_f32_to_tf32", None))  # per version
        return (kind, base.dtype, tuple(value.block_shape), options)
    return (kind, value)


def _make_binder(kernel_params):
    """A function (*args, **kwargs) -> (values in signature order, specialisation key) for a
    kernel's parameters (its `params`: name, is_constexpr, default), written out once so that a
    launch binds its arguments in one Python call (a loop over the parameters cost several
    microseconds per launch). Launch options (num_warps, ...) go into the key in the order given.
    Raises TypeError for a missing or unknown argument."""
    names, params, key = [], [], []
    scope = {"__spec": _specialization}
    for i, p in enumerate(kernel_params):
        names.append(p.name)
        if p.default is _NO_DEFAULT:
            params.append(p.name)
        else:
            scope[f"__default{i}"] = p.default
            params.append(f"{p.name}=__default{i}")
        key.append(p.name if p.is_constexpr else f"__spec({p.name})")
    source = (f"def bind({', '.join(params + ['**__options'])}):\n"
              f"    return [{', '.join(names)}], ({''.join(k + ', ' for k in key)}*__options.items())\n")
    exec(source, scope)  # noqa: S102 - built only from the kernel's own parameter names
    return scope["bind"]


def direct_launch_supported() -> bool:
    """Whether DirectLauncher calls compiled launchers: Triton 3.6 and later 3.x, whose
    JITFunction.run calls them as `run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *all_arguments)` (read in 3.6 and 3.9), and not turned off with
    DMOE_DIRECT_LAUNCH=0 (every launch then goes through `kernel[grid]`)."""
    import os

    import triton

    if os.environ.get("DMOE_DIRECT_LAUNCH", "1") == "0":
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return major == 3 and minor >= 6


def _idle(hook) -> bool:
    """No launch hook: None, or an empty triton.knobs.HookChain (what a profiler adds its hooks to)."""
    return hook is None or not getattr(hook, "calls", True)


class DirectLauncher:
    """`launcher[grid](*args, **kwargs)` does what `kernel[grid](...)` does, at a fraction of its host cost.

    Triton's `kernel[grid](...)` binds and specialises every argument in Python on every call: tens
    of microseconds for a kernel taking TMA descriptors, several times the cost of a torch op, and
    the sparse layer issues about twenty such launches per forward and backward. The first launch of
    each specialisation goes through Triton (which compiles); its compiled kernel is kept under a
    key of the current device and everything Triton specialises on (constexpr values, launch
    options, and `_specialization` of the other arguments), and later calls with that key go to
    the compiled launcher directly.

    Falls back to `kernel[grid]` under Triton's interpreter, for a callable grid, while launch hooks
    (a profiler's) are installed, so that they see every launch, and where `direct_launch_supported`
    says no (another Triton major version, or DMOE_DIRECT_LAUNCH=0).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled = {}
        self._direct = False
        if interpreted(kernel) or not hasattr(kernel, "params"):
            return
        from triton import knobs

        self._direct = direct_launch_supported()
        self._hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        self._binder = _make_binder(kernel.params)

    def __getitem__(self, grid):
        if not self._direct or callable(grid) or not (_idle(self._hooks[0]) and _idle(self._hooks[1])):
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def bind(self, args, kwargs):
        """Every parameter's value in signature order (what the compiled launcher takes, constexprs
        included) and the key of their specialisation; None when an argument is missing."""
        try:
            return self._binder(*args, **kwargs)
        except TypeError:  # a missing or unexpected argument: left to Triton's own error
            return None

    def _launch(self, grid, *args, **kwargs):
        bound = self.bind(args, kwargs)
        # a compiled kernel's function handle belongs to one device's context
        device = torch.cuda.current_device()
        key = None if bound is None else (device, bound[1])
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is None:
            kernel = self.kernel[grid](*args, **kwargs)  # compiles on first use, and launches
            if key is not None:
                if hasattr(kernel, "result"):
                    kernel = kernel.result()
                self._compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            return kernel
        run, function, metadata = compiled
        stream = torch._C._cuda_getCurrentRawStream(device)
        x = grid[0]
        y = grid[1] if len(grid) > 1 else 1
        z = grid[2] if len(grid) > 2 else 1
        run(x, y, z, stream, function, metadata, None, None, None, *bound[0])
        return None


def direct(kernel):
    """The DirectLauncher of a kernel (one per kernel, so that its compiled kernels are kept once);
    while torch.compile traces, torch.library's wrap_triton(kernel), the launch it puts in a graph."""
    if torch.compiler.is_compiling():
        from torch.library import wrap_triton

        return wrap_triton(kernel)  # it needs every argument: a kernel's defaults are not applied
    return _launcher(kernel)


@functools.lru_cache(maxsize=None)
def _launcher(kernel) -> DirectLauncher:
    return DirectLauncher(kernel)
