"""WindowSlots: weight gradients over a window of micro-batches, added into fp32 main_grad once per
window. Against float64 dense references of each micro-batch's S^T @ b, on topologies that change
from micro-batch to micro-batch (experts without tokens, partial blocks, skew), over more than one
window so that slots are reused. On CPU through Triton's interpreter (fp32, fp16)."""
import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as ref
from dmoe_kernels.products.window import WindowSlots

E, F_WIDTH, N, BS = 4, 64, 40, 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}


def _micro_batch(counts, rows_bound, dtype, device):
    counts = torch.tensor(counts, device=device)
    topo = dk.Topology.for_experts(counts, rows_bound, F_WIDTH, BS)
    # the bound (rows_bound) is fixed, the real rows (sum of counts) are not
    data = torch.randn(topo.data_shape(), device=device).to(dtype)
    b = torch.randn(topo.shape[0], N, device=device).to(dtype)
    return data, topo, b


def _real_bound_topology(counts, device):
    return dk.Topology.for_experts(torch.tensor(counts, device=device), sum(counts), F_WIDTH, BS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [1, 3])
def test_window_adds_the_sum_of_its_micro_batches_once_full(window, dtype, device, seeded_by_name):
    rows_bound = 70
    loads = [[5, 0, 40, 17], [0, 70, 0, 0], [16, 16, 16, 16], [1, 2, 3, 4], [0, 0, 0, 0], [33, 1, 0, 30]]
    out = torch.randn(E * F_WIDTH, N, device=device)
    expected = out.double().clone()
    pending = torch.zeros_like(expected)
    slots = None
    for i, counts in enumerate(loads):
        data, topo, b = _micro_batch(counts, rows_bound, dtype, device)
        if slots is None:
            slots = WindowSlots(window, data, topo, b)
        pending += ref.dsd(data.double(), topo, b.double(), transpose=True)
        slots.add(data, topo, b, out)
        if (i + 1) % window == 0:
            expected += pending
            pending.zero_()
        err = float((out.double() - expected).norm() / expected.norm())
        assert err < TOLERANCE[dtype], (i, err)
        # eager adds move the device counter inside a launch (producers store into slot `counter`)
        assert int(slots.counter) == (i + 1) % window


def test_restart_starts_a_new_window(device):
    data, topo, b = _micro_batch([5, 0, 40, 17], 70, torch.float32, device)
    out = torch.zeros(E * F_WIDTH, N, device=device)
    slots = WindowSlots(2, data, topo, b)
    slots.add(data, topo, b, out)
    slots.restart()  # the first micro-batch is dropped with its window
    slots.add(data, topo, b, out)
    assert torch.count_nonzero(out) == 0
    slots.add(data, topo, b, out)
    expected = 2 * ref.dsd(data.double(), topo, b.double(), transpose=True)
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-5


def test_tiles_go_longest_first_and_any_order_sums_the_same(device, seeded_by_name):
    """When a window fills, the experts are ordered by their steps over it (blocks x K steps, an
    empty expert one step a slot), most first, ties by number; the product's sums do not depend
    on that order: the same window summed in reverse order is equal bit for bit."""
    loads = [[5, 0, 40, 17], [0, 33, 0, 16], [16, 17, 16, 0]]
    micro = [_micro_batch(counts, 70, torch.float32, device) for counts in loads]
    slots = WindowSlots(3, *micro[0])
    out = torch.zeros(E * F_WIDTH, N, device=device)
    for data, topo, b in micro:
        slots.add(data, topo, b, out)
    ksteps = BS // slots._config(device).block_k
    steps = [sum(max(-(-counts[e] // BS) * ksteps, 1) for counts in loads) for e in range(E)]
    assert slots.order.tolist() == sorted(range(E), key=lambda e: (-steps[e], e))
    again = torch.zeros_like(out)
    slots.order.copy_(slots.order.flip(0))
    slots.counter.fill_(2)  # the window full again: the product sums its slots
    slots._product(again)
    assert torch.equal(again, out)


def test_micro_batches_of_other_bounds_are_refused(device):
    data, topo, b = _micro_batch([5, 0, 40, 17], 70, torch.float32, device)
    slots = WindowSlots(2, data, topo, b)
    other = _real_bound_topology([5, 0, 40, 17], device)
    bigger = torch.randn(other.data_shape(), device=device)
    with pytest.raises(ValueError, match="differ from the ones the slots were sized for"):
        slots.add(bigger, other, torch.randn(other.shape[0] + 0, N, device=device),
                  torch.zeros(E * F_WIDTH, N, device=device))
    with pytest.raises(ValueError, match="out must be a row-major float32"):
        slots.add(data, topo, b, torch.zeros(E * F_WIDTH, N, device=device, dtype=torch.float64))


def test_the_epilogue_is_checked_before_any_work(device):
    data, topo, b = _micro_batch([5, 0, 40, 17], 70, torch.float32, device)
    with pytest.raises(ValueError, match="use one of pointers, tma_reduce"):
        WindowSlots(2, data, topo, b, epilogue="atomic")
    # the default: the TMA reduce on Hopper's CUDA kernels, pointers through the interpreter
    expected = "pointers" if device.type == "cpu" or torch.cuda.get_device_capability()[0] < 9 else "tma_reduce"
    assert WindowSlots(2, data, topo, b).epilogue == expected
    if device.type == "cpu":  # the interpreter has no TMA reduce
        with pytest.raises(ValueError, match="Triton's interpreter has no TMA reduce; use epilogue='pointers'"):
            WindowSlots(2, data, topo, b, epilogue="tma_reduce")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tma_reduce_epilogue_adds_what_the_pointer_epilogue_adds(dtype, seeded_by_name):
    """At the zoo's tile shapes (block 128, n 768: 128 x 256 tiles in four 64-column strips), skewed
    loads over two windows: the TMA reduce adds each tile once, so out matches the pointer epilogue's
    bit for bit, and both match a float64 reference."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU (TMA reduce)")
    experts, width, n, bs, rows_bound = 8, 512, 768, 128, 4096
    loads = [[900, 0, 2000, 17, 300, 300, 279, 300], [512] * 8, [4096, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]]
    outs = {e: torch.randn(experts * width, n, device="cuda") for e in ("pointers", "tma_reduce")}
    outs["tma_reduce"].copy_(outs["pointers"])
    expected = outs["pointers"].double().clone()
    slots = {}
    for counts in loads * 2:
        topo = dk.Topology.for_experts(torch.tensor(counts, device="cuda"), rows_bound, width, bs)
        data = torch.randn(topo.data_shape(), device="cuda").to(dtype)
        b = torch.randn(topo.shape[0], n, device="cuda").to(dtype)
        expected += ref.dsd(data.double(), topo, b.double(), transpose=True)
        for epilogue, out in outs.items():
            if epilogue not in slots:
                slots[epilogue] = WindowSlots(4, data, topo, b, epilogue=epilogue)
            slots[epilogue].add(data, topo, b, out)
    assert torch.equal(outs["tma_reduce"], outs["pointers"])
    err = float((outs["tma_reduce"].double() - expected).norm() / expected.norm())
    assert err < (1e-5 if dtype == torch.bfloat16 else 3e-3), err  # fp32 operands go through tf32
