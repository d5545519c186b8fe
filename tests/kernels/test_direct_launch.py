"""DirectLauncher: the compiled-launcher path must see every argument in signature order and must
never reuse a compiled kernel for arguments Triton would specialise differently."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from dmoe_kernels.launch import DirectLauncher, direct


def _signature(x_ptr, n, scale, y_ptr=None, BLOCK: tl.constexpr = 64, FLAG: tl.constexpr = False):
    pass


@pytest.fixture
def launcher():
    # a real JITFunction (not the interpreter's), whose parameters the launcher reads; never launched
    return DirectLauncher(JITFunction(_signature))


def test_bind_orders_every_parameter_with_defaults(launcher):
    x = torch.zeros(64)
    values, _ = launcher.bind((x, 5, 1.0), {"BLOCK": 128, "num_warps": 4})
    assert values[0] is x and values[1:] == [5, 1.0, None, 128, False]
    values, _ = launcher.bind((x,), {"scale": 2.0, "n": 3, "FLAG": True})
    assert values[1:] == [3, 2.0, None, 64, True]
    assert launcher.bind((x,), {"scale": 2.0}) is None  # n missing: left to Triton's own error


def test_key_separates_what_triton_specialises(launcher):
    x = torch.zeros(64)

    def key(*args, **kwargs):
        return launcher.bind(args, kwargs)[1]

    base = key(x, 5, 1.0)
    assert key(torch.ones(64), 7, 3.0) == base  # other values, same specialisation
    assert key(x, 5, 1.0, BLOCK=128) != base  # constexpr value
    assert key(x, 5, 1.0, num_warps=8) != key(x, 5, 1.0, num_warps=4)  # launch option
    assert key(x.half(), 5, 1.0) != base  # dtype
    assert key(x[1:], 5, 1.0) != base  # a pointer not 16-byte aligned
    assert key(x, 1, 1.0) != base and key(x, 16, 1.0) != base  # int equal to 1, multiple of 16
    assert key(x, 2**40, 1.0) != base  # int64
    assert key(x, 5, 1.0, y_ptr=x) != base  # a tensor where None was


def test_launches_match_triton(device):
    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(100, device=device)
    for _ in range(3):  # the first launch compiles, the others go straight to the launcher
        direct(add_one)[(triton.cdiv(100, 32),)](x, 100, BLOCK=32)
    torch.testing.assert_close(x, torch.full_like(x, 3.0))
    odd = torch.zeros(101, device=device)[1:]  # misaligned: a second specialisation
    direct(add_one)[(4,)](odd, 100, BLOCK=32)
    direct(add_one)[(4,)](odd, 1, BLOCK=32)  # n == 1: a third
    assert odd[0].item() == 2.0 and odd[1:].eq(1.0).all()
    if device.type == "cuda":  # three specialisations kept, each launched straight after the first time
        assert len(direct(add_one)._compiled) == 3


def test_descriptor_key_reads_only_what_every_triton_version_has(launcher):
    """Triton 3.6's TensorDescriptor has no round_f32_to_tf32: the key must not need it."""

    class Descriptor:  # the fields all versions share
        def __init__(self, base, block_shape):
            self.base, self.block_shape = base, block_shape
            self.shape, self.strides = list(base.shape), list(base.stride())

    x = torch.zeros(64, 64)
    key = launcher.bind((Descriptor(x, [16, 16]), 5, 1.0), {})[1]
    assert key != launcher.bind((Descriptor(x, [32, 16]), 5, 1.0), {})[1]
    assert key != launcher.bind((Descriptor(x.half(), [16, 16]), 5, 1.0), {})[1]


def test_host_helpers_match_triton():
    from dmoe_kernels.launch import cdiv, next_power_of_2

    for n in range(0, 600):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_tma_descriptor_has_the_constructors_fields():
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    from dmoe_kernels.launch import tma_descriptor

    t = torch.zeros(256, 64)[:, :32]  # a strided view, as the products pass
    fast = tma_descriptor(t, [64, 32])
    slow = TensorDescriptor(t, list(t.shape), list(t.stride()), [64, 32])
    assert type(fast) is TensorDescriptor
    for field in dataclasses.fields(TensorDescriptor):
        if field.name != "base":
            assert getattr(fast, field.name) == getattr(slow, field.name), field.name
    assert fast.base is t
    with pytest.raises(AssertionError, match="shape must be positive"):  # the constructor's own check
        tma_descriptor(torch.zeros(0, 64), [64, 32])


def test_direct_launch_can_be_turned_off(monkeypatch):
    from dmoe_kernels.launch import direct_launch_supported

    monkeypatch.setenv("DMOE_DIRECT_LAUNCH", "0")
    assert not direct_launch_supported()
    assert not DirectLauncher(JITFunction(_signature))._direct
