"""Expert-parallel row exchange whose split sizes never leave the device, on any number of hosts:
NVSHMEM through torch's symmetric memory (`torch.ops.symm_mem.all_to_all_vdev`).

The NCCL exchange must read its split sizes on the host before the rows can move, so it cannot run
inside a CUDA graph; the symmetric exchange (symmetric.py) keeps them on the device but needs peer
mappings, which only GPUs of one host have. Here the counts travel by an equal-split all-to-all on
the device (capturable), and the rows by NVSHMEM's variable all-to-all, which reads each rank's
split sizes from symmetric memory on the device: over NVLink within a host and over the network
(InfiniBand/RoCE transports of NVSHMEM) between hosts. Nothing is read on the host, so a layer
that uses it can be captured; captured training has given wrong gradients with it, though, so
training refuses it under CUDA graphs (config/cuda_graphs_rules.py).

The rows go through the same steps as the NCCL exchange (rows sorted by destination rank in, runs of
local-expert groups per source rank out), so the results are the NCCL exchange's, bit for bit.
Every size is a host-known bound, as in symmetric.py: a rank sends at most T*K rows and receives at
most ranks * T*K; the received view is the whole buffer, whose first `counts_by_source.sum()` rows
are real. Buffers are shared by every layer and reused by the next exchange, so a received view is
consumed (copied) before the next exchange starts, as the symmetric exchange's are.

torch allows one symmetric-memory backend per process, fixed by the first allocation: a run uses
this exchange or the symmetric one, never both.

Its send buffers hold at least the bytes that fix the grid of torch's kernel, and rows must be a
multiple of the bytes that grid divides each peer's share by (config/nvshmem_rows.py says why).
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_dmoe.config.nvshmem_rows import row_bytes_problem, send_rows
from megatron_dmoe.parallel.distributed import barrier

from .buffers import built_on_every_rank, grown_capacity


def nvshmem_unavailable_reason() -> Optional[str]:
    """None when torch here has NVSHMEM symmetric memory, else why not (no collective, no CUDA call)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch has no symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev") or not symm_mem.is_nvshmem_available():
        return "this torch build has no NVSHMEM (torch's symmetric memory needs libnvshmem_host.so.3)"
    return None


class NvshmemExchange:
    """NVSHMEM buffers of one expert-parallel group and the row exchanges over them (CUDA only).

    exchange(rows, send_splits) sends rows[sum(send_splits[:i]) : ...] to rank i and returns this
    rank's receive buffer (rank-ordered runs, bound-sized); send_splits is an int64 device tensor."""

    def __init__(self, group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")  # refused once this process allocated with another backend
        self._symm_mem = symm_mem
        self.group = group
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.ranks = dist.get_world_size(group)
        self.device = device
        self.buffers: Dict[Tuple[str, int, torch.dtype], torch.Tensor] = {}
        self._splits: Dict[Hashable, Tuple[Tuple[torch.Tensor, torch.Tensor], ...]] = {}  # forward, backward

    def splits(self, site: Hashable, backward: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """(in_splits [ranks], out_splits_offsets [2, ranks]) of one call site's forward or backward
        exchange, allocated (collectively) at the site's first call, both directions at once: the
        backward allocates nothing. all_to_all_vdev writes each rank's splits into its peers'
        buffers before its barrier, and reads its own after it, with no barrier at its end: a peer
        already in the next call would overwrite splits still being read. No two consecutive
        exchanges share a call site and direction (a layer's dispatch and combine, forward and
        backward), so none share these buffers."""
        if site not in self._splits:
            self._splits[site] = tuple((self._symmetric((self.ranks,), torch.int64),
                                        self._symmetric((2, self.ranks), torch.int64)) for _ in range(2))
        return self._splits[site][int(backward)]

    def _symmetric(self, shape, dtype) -> torch.Tensor:
        t = self._symm_mem.empty(*shape, dtype=dtype, device=self.device)
        self._symm_mem.rendezvous(t, self.group_name)
        return t

    def reserve(self, kind: str, hidden: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """The buffer of this kind, grown to at least `rows`: collective, as SymmetricExchange.reserve."""
        key = (kind, hidden, dtype)
        buf = self.buffers.get(key)
        capacity = grown_capacity(buf.shape[0] if buf is not None else 0, rows, kind, self.group, self.device)
        if capacity is None:
            return buf
        if buf is not None:
            torch.cuda.current_stream(self.device).synchronize()
            barrier(group=self.group)  # no peer still writes into the old buffer
            del self.buffers[key], buf
        self.buffers[key] = buf = self._symmetric((capacity, hidden), dtype)
        return buf

    def exchange(self, rows: torch.Tensor, send_splits: torch.Tensor, send_kind: str, recv_kind: str,
                 recv_rows: Optional[int], bound: int, site: Hashable, backward: bool = False) -> torch.Tensor:
        """rows [n, H] (the first send_splits.sum() real, grouped by destination rank) -> this rank's
        `recv_kind` buffer, rank-ordered runs of what every rank sent here: its first recv_rows rows
        (the exact count, known to the caller), or the whole buffer when recv_rows is None. bound:
        what this rank's share of the group can send it (the buffer grows to the largest bound of
        any rank, so the whole buffer holds what every rank sends, however unequal their tokens).
        site, backward: the call site and direction (see splits)."""
        hidden, dtype = rows.shape[1], rows.dtype
        row_bytes = hidden * rows.element_size()
        problem = row_bytes_problem(row_bytes, self.ranks)
        if problem is not None:
            raise ValueError(problem)
        send = self.reserve(send_kind, hidden, dtype, send_rows(rows.shape[0], row_bytes))
        # the backward sends from this one: it gets the send floor now, so that no backward grows a
        # buffer whose address a captured forward holds
        recv = self.reserve(recv_kind, hidden, dtype, send_rows(bound, row_bytes))
        send[: rows.shape[0]].copy_(rows)
        in_splits, out_splits_offsets = self.splits(site, backward)
        in_splits.copy_(send_splits)
        self._all_to_all(send, recv, in_splits, out_splits_offsets)
        return recv if recv_rows is None else recv[:recv_rows]

    def _all_to_all(self, send, recv, in_splits, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits_offsets, self.group_name)


class _Exchange(torch.autograd.Function):
    """Rows to the ranks `send_splits` says (device int64 [ranks]); backward: their gradients back,
    by the received splits."""

    @staticmethod
    def forward(ctx, rows, exchange, send_splits, recv_splits, recv_rows, bound, kinds, site):
        ctx.exchange, ctx.kinds, ctx.site = exchange, kinds, site
        ctx.send_rows = rows.shape[0]
        ctx.save_for_backward(recv_splits)
        return exchange.exchange(rows, send_splits, kinds[0], kinds[1], recv_rows, bound, site)

    @staticmethod
    def backward(ctx, grad):
        (recv_splits,) = ctx.saved_tensors
        # the gradients return to exactly the rows this rank sent; the buffer is reused: copied out
        back = ctx.exchange.exchange(grad.contiguous(), recv_splits, ctx.kinds[1], ctx.kinds[0], ctx.send_rows,
                                     ctx.send_rows, ctx.site, backward=True)
        return back.clone(), None, None, None, None, None, None, None


def send_to_experts(rows: torch.Tensor, exchange: NvshmemExchange, send_splits: torch.Tensor,
                    recv_splits: torch.Tensor, site: Hashable) -> torch.Tensor:
    """Differentiable NVSHMEM exchange of T*K rows sorted by destination rank (send_splits [ranks]
    to each; recv_splits [ranks]: what each rank sends here). Returns this rank's whole receive
    buffer, at least ranks * T*K rows, whose first recv_splits.sum() are real: consume it (copy)
    before the next exchange. site: the caller (a layer's dispatcher), see NvshmemExchange.splits."""
    kinds = ("to_experts_send", "to_experts")
    return _Exchange.apply(rows, exchange, send_splits, recv_splits, None, exchange.ranks * rows.shape[0], kinds,
                           (site, "to_experts"))


def send_to_sources(rows: torch.Tensor, exchange: NvshmemExchange, send_splits: torch.Tensor,
                    recv_splits: torch.Tensor, recv_rows: int, site: Hashable) -> torch.Tensor:
    """The experts' outputs (arrival order, send_splits [ranks] rows back to each source) -> the
    [recv_rows, H] view of this rank's receive buffer (recv_rows: the T*K rows it sent out, in its
    sorted order): consume it (copy) before the next exchange. site: as for send_to_experts."""
    kinds = ("to_sources_send", "to_sources")
    return _Exchange.apply(rows, exchange, send_splits, recv_splits, recv_rows, recv_rows, kinds, (site, "to_sources"))


class NvshmemExchanges:
    """The NVSHMEM exchanges of one run, one per expert-parallel group and device."""

    def __init__(self):
        self._by_key: Dict[Tuple[str, str], NvshmemExchange] = {}

    def get(self, group, device: torch.device) -> Tuple[Optional[NvshmemExchange], str]:
        """(the exchange, "") or (None, why not); collective over the group, and every rank reaches
        the same answer."""
        if device.type != "cuda":
            return None, f"NVSHMEM needs CUDA devices, not {device.type}"
        key = (group.group_name, str(device))
        if key in self._by_key:
            return self._by_key[key], ""
        exchange, reason = built_on_every_rank(lambda: NvshmemExchange(group, device), "NVSHMEM", group, device,
                                               unavailable=nvshmem_unavailable_reason())
        if exchange is None:
            return None, reason
        self._by_key[key] = exchange
        return exchange, ""
