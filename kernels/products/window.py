"""Weight gradients over a window of W micro-batches, for dMoE topologies: each micro-batch's
operands are copied into slot `counter` of a `WindowSlots`, and when the window is full (counter ==
W - 1) one product sums all W slots' S^T @ B into the fp32 gradient, read and written once.

Nothing is read on the host: the slot, the used rows and blocks, and whether the window is full
are read by the kernels on the device, so a captured backward launches the same kernels at every
micro-batch (the product kernel returns at once until the window is full).

  WindowSlots            the stacked slot buffers of one weight, and its counter
  WindowSlots.add        stash one micro-batch's (data, topology, b) and its expert offsets
                         (ordering the experts by their work when the window fills), add the
                         window's sum into out when it is full, move the counter on; data=None when the kernel
                         that made it stored it into `data_slot` already (the activation's
                         backward does: activations/ops.py); b=None likewise for `b_slot`
                         (the permutation's expand of the output gradient)

The product adds its tiles into out by the tensor-memory accelerator's reduce (`epilogue=
"tma_reduce"`, Hopper's bulk reduce-add: the program goes on to its next tile without waiting for
out's old values) or through pointers (`"pointers"`: load, add, store). The default takes the TMA
reduce on GPUs with TMA (compute capability 9 or newer): it adds the same sums bit for bit and was
measured faster (docs/kernels.md); the interpreter and older GPUs take pointers.
"""
from __future__ import annotations

import torch

from ..launch import (
    check_launchable,
    direct,
    dot_precision,
    interpreted,
    persistent_programs,
    tma_descriptor,
    tma_ready,
)
from .kernels import dsdt_window as _window_module
from .topology import Topology
from .tuning import DsdConfig, dsd_config

_COPY_BLOCK = 4096
_COPY_PROGRAMS_PER_SM = 4
EPILOGUES = ("pointers", "tma_reduce")
_REDUCE_STRIP = 64  # columns of out per TMA reduce: an fp32 [128, 64] staging block, 32 KB
_ORDER_BLOCK = 64  # experts compared at once when ordering them ([64, 64] comparisons)


def default_epilogue(device: torch.device) -> str:
    """The TMA reduce where the kernel is compiled for a GPU with TMA, else pointers."""
    if interpreted(_window_module.dsdt_window_kernel) or device.type != "cuda":
        return "pointers"
    return "tma_reduce" if torch.cuda.get_device_capability(device)[0] >= 9 else "pointers"


class WindowSlots:
    """W slots for the operands of one expert weight's gradient S^T @ b (S = (data, topology), a
    dMoE topology of `max_blocks` blocks of bs x bs and `rows` padded rows; b [rows, n]), their
    topologies' padded expert offsets, and the device counter saying which slot the next
    micro-batch fills. Sized once, by the first micro-batch: every later one must have the same
    bounds (a training run's micro-batches all do)."""

    def __init__(self, window: int, data: torch.Tensor, topology: Topology, b: torch.Tensor,
                 epilogue: str | None = None, config: DsdConfig | None = None):
        if window < 1:
            raise ValueError(f"window={window} must be at least 1")
        if epilogue is None:
            epilogue = default_epilogue(b.device)
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue={epilogue!r}: use one of {', '.join(EPILOGUES)}")
        if epilogue == "tma_reduce" and interpreted(_window_module.dsdt_window_kernel):
            raise ValueError("epilogue='tma_reduce' needs a GPU with TMA (Hopper or newer): Triton's interpreter "
                             "has no TMA reduce; use epilogue='pointers'")
        self.epilogue = epilogue
        self.config = config  # None: dsd_config's choice for the shapes (tools/bench_wgrad_window.py sweeps others)
        if not topology.blocks_per_row or topology.expert_offsets is None:
            raise ValueError("WindowSlots takes dMoE topologies (Topology.for_experts)")
        self.window = window
        if max(data.numel(), b.numel()) >= 2**31:
            raise ValueError(f"WindowSlots: an operand of {max(data.numel(), b.numel())} elements is beyond the "
                             "copy kernel's 32-bit indices (2**31); use fewer tokens per micro-batch")
        dev = b.device
        self.data = torch.zeros((window, *data.shape), dtype=data.dtype, device=dev)
        self.b = torch.zeros((window, *b.shape), dtype=b.dtype, device=dev)
        self.offsets = torch.zeros((window, topology.expert_offsets.numel()), dtype=torch.int32, device=dev)
        # the experts by their steps over the window, most first: the product's tile order
        self.order = torch.arange(topology.expert_offsets.numel() - 1, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self._slot_values = torch.arange(window, dtype=torch.int32, device=dev)  # slot w read from [w]
        # the counter's value as the host knows it; None for good once an add was captured
        self._host_slot: int | None = 0
        self.block_size = topology.block_size
        self.blocks_per_row = topology.blocks_per_row

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.b, self.offsets))

    @property
    def data_slot(self):
        """(stacked data slots, counter): where a producing kernel stores S's blocks itself, into
        slot `counter`, before add(None, ...)."""
        return self.data, self.counter

    @property
    def b_slot(self):
        """(stacked b slots, counter): where a producing kernel stores b's rows itself (the
        permutation's expand: ops.expand(..., out=, slot=)), before add(..., b=None, ...)."""
        return self.b, self.counter

    def restart(self) -> None:
        """The next micro-batch fills slot 0 (a new training step; slots need no clearing)."""
        self.counter.zero_()
        if self._host_slot is not None:
            self._host_slot = 0

    def add(self, data, topology: Topology, b: torch.Tensor, out: torch.Tensor) -> None:
        """Stash this micro-batch's operands; when they complete the window, out += the sum over its
        slots of S_w^T @ b_w (out: fp32 [E * F * bs, n], row-major). Then the counter moves on.
        data None: S's used blocks are in slot `counter` already (see data_slot); b None: b's used
        rows are (see b_slot), and the launch that stashes the offsets copies nothing.

        Run eagerly, the host knows the slot (it counts the adds since the last restart): the
        kernels read it from a constant, the copy's launch moves the device counter on, and the
        product is launched only when the window is full: two launches a micro-batch (the copy of
        b with the offsets, and the product when full) where a captured add makes four.
        Captured, and for good once an add was captured (replays move the counter without the
        host), every launch reads the device counter and the product returns at once while the
        window is not full."""
        self._check(data, topology, b, out)
        dev = out.device
        host_slot = self._host_slot
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # replays move the counter without the host, for good: eager adds between them must
            # read the device counter too
            host_slot = self._host_slot = None
        slot = self.counter if host_slot is None else self._slot_values[host_slot:host_slot + 1]
        programs = persistent_programs(dev, _COPY_PROGRAMS_PER_SM)
        copy = direct(_window_module.copy_to_slot_kernel)
        bs2 = self.block_size * self.block_size
        offsets = topology.expert_offsets
        # the used (padded) rows of b with the offsets (and the order when the window fills), then
        # the used blocks of S: counts read on the device
        bs = self.block_size
        # (b None: its rows are in the slot already; one program stashes the offsets alone)
        b_programs = programs if b is not None else 1
        copy[(b_programs,)](self.b if b is None else b, self.b, slot, offsets[-1:], 0, self.b[0].numel(), b_programs,
                          COUNT_SCALE=self.b.shape[2], HAS_COUNT=b is not None, BLOCK=_COPY_BLOCK,
                          new_offsets_ptr=offsets, offsets_ptr=self.offsets, order_ptr=self.order,
                          next_counter_ptr=self.counter, num_experts=self.order.numel(), OFFSETS=True,
                          ADVANCE=host_slot is not None, W=self.window, BS=bs,
                          KSTEPS=bs // self._config(dev).block_k, BLOCK_E=_ORDER_BLOCK)
        if data is not None:
            copy[(programs,)](data, self.data, slot, topology.nnz, 0, self.data[0].numel(), programs,
                              COUNT_SCALE=bs2, HAS_COUNT=True, BLOCK=_COPY_BLOCK)
        if host_slot is None:
            self._product(out)
            self.counter.add_(1).remainder_(self.window)
            return
        if host_slot == self.window - 1:
            self._product(out, slot)
        self._host_slot = (host_slot + 1) % self.window

    def _config(self, device: torch.device) -> DsdConfig:
        return self.config or dsd_config(self.block_size, self.b.shape[-1], True, device, True, self.b.dtype)

    def _product(self, out: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """out += the window's sum if the slot (default: the device counter) is the last one."""
        kernel = _window_module.dsdt_window_kernel
        check_launchable(kernel, out.device)
        bs, W, n = self.block_size, self.window, self.b.shape[-1]
        cfg = self._config(out.device)
        num_experts = self.order.numel()
        s_rows = self.data[0].numel() // bs  # one slot's rows of the data viewed [-1, bs]
        b_rows = self.b.shape[1]
        tiles = num_experts * self.blocks_per_row * -(-n // cfg.block_n)
        grid = max(1, min(persistent_programs(out.device, cfg.programs_per_sm), tiles))
        strip = min(_REDUCE_STRIP, cfg.block_n)
        reduce = self.epilogue == "tma_reduce" and tma_ready(out)
        direct(kernel)[(grid,)](
            tma_descriptor(self.data.view(-1, bs), [cfg.block_k, bs]),
            tma_descriptor(self.b.view(-1, n), [cfg.block_k, cfg.block_n]),
            self.offsets, self.order, self.counter if slot is None else slot, out, out.stride(0),
            n, num_experts, grid, s_rows, b_rows, W * s_rows, W * b_rows,
            F=self.blocks_per_row, W=W, BS=bs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            DOT_PRECISION=dot_precision(self.b.dtype, out.device), COUNT_CHUNK=64,
            c_desc=tma_descriptor(out, [bs, strip]) if reduce else None, TMA_REDUCE=reduce, STRIP=strip,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def _check(self, data, topology, b, out) -> None:
        if data is None:
            data = self.data[0]
        if b is None:
            b = self.b[0]
        if (tuple(data.shape) != tuple(self.data.shape[1:]) or tuple(b.shape) != tuple(self.b.shape[1:])
                or data.dtype != self.data.dtype or b.dtype != self.b.dtype
                or topology.block_size != self.block_size or topology.blocks_per_row != self.blocks_per_row
                or topology.expert_offsets is None
                or topology.expert_offsets.numel() != self.offsets.shape[1]):
            raise ValueError(
                f"WindowSlots: this micro-batch's operands (data {tuple(data.shape)} {data.dtype}, b "
                f"{tuple(b.shape)} {b.dtype}) differ from the ones the slots were sized for (data "
                f"{tuple(self.data.shape[1:])}, b {tuple(self.b.shape[1:])}); every micro-batch of a window "
                "must have the same bounds")
        if not (data.is_contiguous() and b.is_contiguous()):
            raise ValueError("WindowSlots: data and b must be contiguous")
        rows = topology.expert_offsets.numel() - 1
        shape = (rows * self.blocks_per_row * self.block_size, b.shape[1])
        if (out.dtype != torch.float32 or tuple(out.shape) != shape or out.stride(1) != 1
                or out.stride(0) < shape[1] or out.device != b.device):
            raise ValueError(f"WindowSlots: out must be a row-major float32 {shape} tensor on {b.device}, got "
                             f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())} on {out.device}")
