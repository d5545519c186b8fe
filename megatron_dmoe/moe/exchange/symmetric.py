"""Expert-parallel token exchange through symmetric memory: rows stored straight into peer GPUs.

The NCCL path needs every split size on the host before the rows can move, so each rank stalls on
a host round trip between the count exchange and the row exchange, and the exchange waits for the
slowest rank. Here every buffer is mapped into every GPU of the expert-parallel group (torch's
symmetric memory over NVLink), and Triton kernels write rows directly to their destination:

  dispatch  1. each rank stores its counts per virtual expert into row `me` of every rank's inbox
               [ranks, V]; barrier. Every rank now holds the whole count matrix, so all offsets
               are computed on the device (`exchange_plan`): where my rows start in each
               destination's buffer, where each source's rows start in mine.
            2. one kernel stores each routed copy's token row at its arrival row in the
               destination's `to_experts` buffer (runs of local-expert groups per source rank, the
               layout the NCCL path delivers); barrier. The row follows from the copy's position
               in expert order (a counting sort, no radix sort); no sorted send buffer is written.
  combine   one kernel stores each output row back into its sender's `to_sources` buffer at the
            row the copy had in the sender's sorted order; barrier; the weighted sum follows.
  backward  the same two stores in the other direction (gradients of received rows go back to
            `to_sources`, gradients of outputs out to `to_experts`).

Nothing is read back to the host, so the exchange runs inside CUDA graphs. Every size is a host-
known bound: a rank sends T*K rows (its routed copies) and receives at most ranks * T*K (every
rank's copies all routed to its experts). The `to_experts` buffer holds that bound for the largest
T any rank of the group has passed, and the received view is the whole buffer, of which the first
`tokens_per_expert.sum()` rows (on the device) are real; the experts read only those. No routing,
however skewed, can overflow it, and no token is ever dropped.

Buffers are reused by every layer. That is safe because the two buffers alternate (every exchange
toward the experts is followed by one toward the sources and back), each exchange ends with a
barrier, and a received view is consumed (copied by the experts' permutation, or cloned) before
the next exchange starts. They are allocated at the first call, collectively, at the largest size
any rank asks for, and grown the same way when a rank passes more tokens than any did before;
ranks must change their token counts together (megatron's schedules do: micro-batch and sequence
sizes are global settings). Never during a capture.

Only for ranks of one host (CUDA peer mappings); the dispatcher falls back to NCCL otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .buffers import built_on_every_rank, grown_capacity
from .nvshmem import NvshmemExchanges

if TYPE_CHECKING:  # the launchers import triton, a Linux-only dependency: imported where they run
    from dmoe_kernels.exchange.ops import ExchangePlan



@dataclass
class _RowsBuffer:
    tensor: torch.Tensor
    handle: object
    ptrs: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.tensor.shape[0]


class SymmetricExchange:
    """Symmetric buffers of one expert-parallel group and the exchanges over them (CUDA only)."""

    def __init__(self, group, num_virtual_experts: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.local_experts = num_virtual_experts // self.ranks
        self.device = device
        self.inbox = symm_mem.empty(self.ranks, num_virtual_experts, dtype=torch.int32, device=device)
        self.handle = symm_mem.rendezvous(self.inbox, group)
        self.inbox_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.buffers: Dict[Tuple[str, int, torch.dtype], _RowsBuffer] = {}
        # programs of each push kernel (None: two per multiprocessor). Fewer leave multiprocessors
        # to work on other streams (a shared expert) while rows cross NVLink.
        self.push_programs: Optional[int] = None

    def barrier(self, channel: int) -> None:
        self.handle.barrier(channel=channel)

    def plan(self, counts: torch.Tensor) -> ExchangePlan:
        """Post this rank's counts, wait for everyone's, and compute the offsets on the device."""
        from dmoe_kernels.exchange.ops import exchange_plan, post_counts

        post_counts(counts, self.inbox_ptrs, self.me)
        self.barrier(channel=0)
        return exchange_plan(self.inbox, self.me, self.local_experts)

    def buffer(self, kind: str, hidden: int, dtype: torch.dtype) -> Optional[_RowsBuffer]:
        return self.buffers.get((kind, hidden, dtype))

    def reserve(self, kind: str, hidden: int, dtype: torch.dtype, rows: int) -> _RowsBuffer:
        """The buffer of this kind, grown to at least `rows` if needed. Growing is collective: every
        rank reaches it in the same call, since all pass the same token count; the ranks still agree
        on the size (the largest asked for). Never while a CUDA graph is captured."""
        buf = self.buffer(kind, hidden, dtype)
        capacity = grown_capacity(buf.capacity if buf is not None else 0, rows, kind, self.group, self.device)
        if capacity is None:
            return buf
        if buf is not None:
            torch.cuda.current_stream(self.device).synchronize()  # no kernel of ours still reads it
            self.barrier(channel=0)  # nor any peer's
            torch.cuda.current_stream(self.device).synchronize()
            del self.buffers[(kind, hidden, dtype)], buf
        tensor = self._symm_mem.empty(capacity, hidden, dtype=dtype, device=self.device)
        handle = self._symm_mem.rendezvous(tensor, self.group)
        ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=self.device)
        self.buffers[(kind, hidden, dtype)] = buf = _RowsBuffer(tensor, handle, ptrs)
        return buf

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor,
                 plan: ExchangePlan) -> torch.Tensor:
        """Every routed copy of the token rows x to its expert's rank; returns this rank's whole buffer,
        at least [ranks * T*K, H] (arrival order; the first tokens_per_expert.sum() rows are real)."""
        hidden, dtype = x.shape[1], x.dtype
        plan.send_rows = experts.numel()
        self.reserve("to_sources", hidden, dtype, plan.send_rows)
        buf = self.reserve("to_experts", hidden, dtype, self.ranks * plan.send_rows)
        plan.recv_rows = buf.capacity  # a bound for every rank's T, not only this one's
        from dmoe_kernels.exchange.ops import push_copies

        push_copies(x, experts, positions, plan, buf.ptrs, buf.capacity, self.local_experts, self.push_programs)
        self.barrier(channel=1)
        return buf.tensor[: plan.recv_rows]

    def _per_destination(self) -> Optional[int]:
        return None if self.push_programs is None else max(1, self.push_programs // self.ranks)

    def to_experts(self, src: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """Rows in this rank's sorted order -> arrival order on the expert ranks; returns the view
        [plan.recv_rows, H] of this rank's buffer (sized by the dispatch)."""
        from dmoe_kernels.exchange.ops import push_rows

        buf = self.buffer("to_experts", src.shape[1], src.dtype)
        push_rows(src, plan.send_starts, plan.dest_base, buf.ptrs, buf.capacity, self.me, self._per_destination())
        self.barrier(channel=1)
        return buf.tensor[: plan.recv_rows]

    def to_sources(self, src: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
        """Rows in arrival order -> back to their senders, at the row each had in the sender's sorted
        order; returns the view [plan.send_rows, H] of this rank's buffer."""
        from dmoe_kernels.exchange.ops import push_rows

        buf = self.buffer("to_sources", src.shape[1], src.dtype)
        push_rows(src, plan.recv_starts, plan.return_base, buf.ptrs, buf.capacity, self.me, self._per_destination())
        self.barrier(channel=1)
        return self.returned_rows(src.shape[1], src.dtype, plan)

    def returned_rows(self, hidden: int, dtype: torch.dtype, plan: ExchangePlan) -> torch.Tensor:
        """The view [plan.send_rows, hidden] of this rank's to_sources buffer: its copies' rows as
        they came back, in its sorted order (valid after the barrier that ends their pushes)."""
        return self.buffer("to_sources", hidden, dtype).tensor[: plan.send_rows]


class SymmetricExchanges:
    """The symmetric exchanges of one run, one per group, virtual expert count and device, shared
    by every layer of its model (their buffers are the big part): owned by the run's MoE state
    (moe/run_state.py) and dropped with it."""

    def __init__(self):
        self._by_key: Dict[Tuple[str, int, str], SymmetricExchange] = {}
        self._push_programs: Optional[int] = None
        self.nvshmem = NvshmemExchanges()  # the exchanges across hosts (nvshmem.py), when a run uses them

    def set_push_programs(self, programs: Optional[int]) -> None:
        """Programs of every push kernel of these exchanges, present and future (None: the default)."""
        self._push_programs = programs
        for exchange in self._by_key.values():
            exchange.push_programs = programs

    def get(self, group, num_virtual_experts: int, device: torch.device) -> Tuple[Optional[SymmetricExchange], str]:
        """(the exchange, "") or (None, why not). Collective over the group the first time: every
        rank must call it, and all ranks reach the same answer (a failure on any rank is a failure
        on all)."""
        if device.type != "cuda":
            return None, f"symmetric memory needs CUDA devices, not {device.type}"
        key = (dist.get_group_name(group) if hasattr(dist, "get_group_name") else str(id(group)),
               num_virtual_experts, str(device))
        if key in self._by_key:
            return self._by_key[key], ""
        reason = symmetric_unavailable_reason(group, device)
        if reason is not None:
            return None, reason

        def build() -> SymmetricExchange:
            exchange = SymmetricExchange(group, num_virtual_experts, device)
            exchange.push_programs = self._push_programs
            return exchange

        exchange, reason = built_on_every_rank(build, "symmetric memory", group, device)
        if exchange is None:
            return None, reason
        self._by_key[key] = exchange
        return exchange, ""


def symmetric_unavailable_reason(group, device: torch.device) -> Optional[str]:
    """None when the group (of CUDA ranks) can exchange through symmetric memory, else why not.
    Collective over the group (every rank must call it)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch has no symmetric memory ({exc})"
    import socket

    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return f"the expert-parallel group spans {len(set(hosts))} hosts; peer mappings need one host"
    return None


class _ToExperts(torch.autograd.Function):
    """Token rows -> the expert ranks (dispatch). Backward: the received rows' gradients come back
    into this rank's sorted order and are summed over each token's copies. With `returned` the
    experts' backward has already stored them into to_sources (the gradient passed here is a
    placeholder): they are read there."""

    @staticmethod
    def forward(ctx, x, experts, positions, exchange, plan, returned):
        ctx.exchange, ctx.plan, ctx.returned = exchange, plan, returned
        ctx.save_for_backward(positions)
        return exchange.dispatch(x, experts, positions, plan)

    @staticmethod
    def backward(ctx, grad):
        from dmoe_kernels.launch import bind_device
        from dmoe_kernels.permutation.ops import reduce

        (positions,) = ctx.saved_tensors
        bind_device(grad)  # autograd's worker thread
        if ctx.returned:
            grad_sorted = ctx.exchange.returned_rows(grad.shape[1], grad.dtype, ctx.plan)
        else:
            grad_sorted = ctx.exchange.to_sources(grad.contiguous(), ctx.plan)

        return reduce(grad_sorted, positions), None, None, None, None, None


class _ToSources(torch.autograd.Function):
    """Expert outputs -> back to their senders' sorted order (combine). Backward: the gradients go
    out to the expert ranks again."""

    @staticmethod
    def forward(ctx, y, exchange, plan):
        ctx.exchange, ctx.plan = exchange, plan
        return exchange.to_sources(y.contiguous(), plan)

    @staticmethod
    def backward(ctx, grad):
        from dmoe_kernels.launch import bind_device

        bind_device(grad)  # autograd's worker thread
        return ctx.exchange.to_experts(grad.contiguous(), ctx.plan), None, None


def send_to_experts(x, experts, positions, exchange: SymmetricExchange, plan: ExchangePlan,
                    returned: bool = False) -> torch.Tensor:
    """x [T, H], experts/positions [T, K] (virtual expert, sorted position of each copy) -> the
    [recv_rows, H] view of the exchange's buffer: consume it (copy) before the next exchange.
    returned: the experts' backward stores the received rows' gradients into the senders'
    to_sources buffers itself (experts/sparse_returning.py)."""
    return _ToExperts.apply(x, experts, positions, exchange, plan, returned)


def send_to_sources(y, exchange: SymmetricExchange, plan: ExchangePlan) -> torch.Tensor:
    """[send_rows, H] view of the exchange's buffer: consume it (copy) before the next exchange."""
    return _ToSources.apply(y, exchange, plan)
