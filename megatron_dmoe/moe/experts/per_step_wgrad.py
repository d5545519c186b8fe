"""Expert weight gradients once per training step, or once per window of micro-batches, instead
of once per micro-batch.

Per micro-batch, each expert weight's gradient S^T @ B is added into its fp32 main_grad: a read and
a write of the whole buffer (4 bytes x 2 per parameter) for a product whose reduction is only the
expert's few hundred tokens, so the kernel is bound by the buffer, not by its FLOPs. Inside
`WgradStash.per_step()`, the sparse experts' backward keeps the product's operands
instead (`stash`), and on leaving the block all micro-batches' operands go through ONE product per
weight, over their rows regrouped by expert (dmoe_kernels.permutation.ops): main_grad is read and written
once per step, and each reduction is as long as all micro-batches' tokens.

The price is memory: each micro-batch's activation (or its gradient) and the expert input (or
output gradient) stay alive until the step's end, about 2 x tokens x top-k x (ffn + hidden) x 2 bytes
per MoE layer and micro-batch. Only weights whose gradient goes straight into main_grad (marked
`main_grad_only`: DDP reduces after backward) are deferred; CUDA graph captures never are.

A window of W micro-batches (`use_window(W)`, moe.expert_wgrad_window) is the form captured layers
hold: each micro-batch's operands go into slot buffers made at its first call, and a product over
the W slots adds into main_grad when the window is full (dmoe_kernels' WindowSlots; every decision
on the device, so a replayed backward does the same). The sparse experts' backward has its
activation pass store the wide operands into the slots (`window_slots`, then `windowed` with no
data); the narrow ones are copied. Memory: W x the operands' bound per weight, for the whole run.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron_dmoe.parallel import param_roles


class WgradStash:
    """How one run's sparse experts hand their weight gradients to main_grad, owned by the run
    (moe/run_state.py) and shared by every MoE layer of its model:

    - the deferred operands, id(weight) -> (weight, [data], [topology], [B]), or None outside
      `per_step()`;
    - which weights' main_grad still holds the zeros the loop put there (`main_grads_zeroed()`):
      a weight's first gradient of the step is then stored rather than added (`first_write`), so the
      kernel's epilogue never reads the old values. None (the default, and outside a training loop
      that says so): always added.
    """

    def __init__(self):
        self._pending: Optional[Dict[int, Tuple[torch.Tensor, List, List, List]]] = None
        self._written: Optional[set] = None
        self.window = 1
        self._slots: Dict[int, Tuple[torch.Tensor, object]] = {}  # id(weight) -> (weight, WindowSlots)

    def use_window(self, window: int) -> None:
        """Weight gradients once per `window` micro-batches (1: per micro-batch); before training."""
        if window < 1:
            raise ValueError(f"moe.expert_wgrad_window={window} must be at least 1")
        self.window = window
        self._slots = {}

    def main_grads_zeroed(self) -> None:
        """The training loop has just zeroed every main_grad (DDP's zero_grad_buffer): a new step,
        whose first micro-batch starts every window again."""
        self._written = set()
        for _, slots in self._slots.values():
            slots.restart()

    def window_bytes(self) -> int:
        """Device memory the windows' slots hold."""
        return sum(slots.nbytes() for _, slots in self._slots.values())

    def window_slots(self, weight: torch.Tensor, data: torch.Tensor, topology, b: torch.Tensor):
        """The WindowSlots of weight's gradient S^T @ b (S = (data, topology)), made for these
        operands' bounds at its first call; None when not windowing (window 1, a per-step block, a
        topology that is not the dMoE one, or slots not yet made while a graph is captured)."""
        if (self.window == 1 or self._pending is not None or not topology.blocks_per_row
                or topology.expert_offsets is None):
            return None
        from dmoe_kernels.products.window import WindowSlots

        entry = self._slots.get(id(weight))
        if entry is None:
            if b.is_cuda and torch.cuda.is_current_stream_capturing():
                # slots made inside a capture would be zeroed at every replay: this weight's graph
                # accumulates per micro-batch (training runs a step eagerly before capturing)
                return None
            entry = self._slots[id(weight)] = (weight, WindowSlots(self.window, data, topology, b))
        return entry[1]

    def windowed(self, weight: torch.Tensor, data: Optional[torch.Tensor], topology,
                 b: Optional[torch.Tensor]) -> bool:
        """Hand weight's gradient (S^T @ b) to its window, which adds into main_grad when full. False
        when not windowing (see window_slots): the caller adds now. data None: S is in the window's
        slot already (its producer stored it there through window_slots(...).data_slot); b None
        likewise (through .b_slot)."""
        if data is None or b is None:
            slots = self._slots[id(weight)][1]
        else:
            slots = self.window_slots(weight, data, topology, b)
        if slots is None:
            return False
        E, f, h = weight.shape
        slots.add(data, topology, b, param_roles.main_grad(weight).view(E * f, h))
        return True

    def first_write(self, weight: torch.Tensor) -> bool:
        """True for the first gradient of `weight` since main_grads_zeroed(): it may overwrite
        main_grad. Every call counts, whatever the caller then does with the gradient; never while a
        CUDA graph is captured (its replays would overwrite at every micro-batch)."""
        if self._written is None or id(weight) in self._written:
            return False
        self._written.add(id(weight))
        return not (weight.is_cuda and torch.cuda.is_current_stream_capturing())

    @contextlib.contextmanager
    def per_step(self, enabled: bool = True) -> Iterator[None]:
        """Defer the sparse experts' weight gradients of every backward inside the block to its end.

        On a normal exit the deferred gradients are added into the weights' main_grad, so wrap the
        whole step's backward passes and reduce gradients after the block. On an exception they are
        dropped with the stash.
        """
        if not enabled:
            yield
            return
        if self._pending is not None:
            raise RuntimeError("WgradStash.per_step() blocks cannot be nested")
        self._pending = {}
        try:
            yield
            _flush(self._pending, self)
        finally:
            self._pending = None

    def stash(self, weight: torch.Tensor, data: torch.Tensor, topology, b: torch.Tensor) -> bool:
        """Keep the operands of weight's gradient (S^T @ b, S = (data, topology)) for the end of the
        step. False when not deferring: the caller computes the gradient now."""
        if self._pending is None or not topology.blocks_per_row or topology.expert_offsets is None:
            return False
        if b.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # a graph replays its kernels every step; nothing may be left for later
        entry = self._pending.setdefault(id(weight), (weight, [], [], []))
        entry[1].append(data)
        entry[2].append(topology)
        entry[3].append(b)
        return True


def _flush(pending: Dict[int, Tuple[torch.Tensor, List, List, List]], stash: WgradStash) -> None:
    from dmoe_kernels.permutation.ops import summed_transposed_products

    while pending:  # one weight at a time, releasing its operands before the next
        _, (weight, datas, topologies, dense) = pending.popitem()
        E, f, h = weight.shape
        summed_transposed_products(datas, topologies, dense, param_roles.main_grad(weight).view(E * f, h),
                                   accumulate=not stash.first_write(weight))
