"""The NVSHMEM exchange's buffers (moe/exchange/nvshmem.py) reach their size in the forward: a
backward sends from the forward's receive buffer and receives into its send buffer, and must grow
neither, since a captured forward graph holds their addresses. In one gloo process, with host
tensors standing in for symmetric memory and a copy for NVSHMEM's all-to-all (one rank)."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_dmoe.config.nvshmem_rows import send_rows
from megatron_dmoe.moe.exchange.nvshmem import NvshmemExchange, send_to_experts, send_to_sources

HIDDEN = 16  # 64-byte fp32 rows: the multiple one rank needs


class _HostExchange(NvshmemExchange):
    def __init__(self, group):  # no symmetric-memory backend: host tensors
        self.group, self.group_name, self.ranks = group, "host", 1
        self.device = torch.device("cpu")
        self.buffers, self._splits = {}, {}
        self.made = []

    def _symmetric(self, shape, dtype):
        self.made.append(shape)
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype)  # a row read before it is written shows
        return torch.zeros(shape, dtype=dtype)

    def _all_to_all(self, send, recv, in_splits, out_splits_offsets):
        n = int(in_splits[0])
        recv[:n].copy_(send[:n])
        out_splits_offsets.zero_()
        out_splits_offsets[0, 0] = n


@pytest.fixture
def group(tmp_path):
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


def _layer_round_trip(exchange, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, requires_grad=True)
    splits = torch.tensor([tokens], dtype=torch.int64)
    received = send_to_experts(x, exchange, splits, splits, site="layer")  # the whole bound-sized buffer
    y = send_to_sources(received * 3.0, exchange, splits, splits, tokens, site="layer")
    return x, y


def test_the_backward_grows_no_buffer(group):
    exchange = _HostExchange(group)
    x, y = _layer_round_trip(exchange, tokens=50, seed=0)
    torch.testing.assert_close(y, 3.0 * x.detach())
    after_forward = {kind: buf for kind, buf in exchange.buffers.items()}
    made = len(exchange.made)
    floor = send_rows(1, HIDDEN * 4)
    assert all(buf.shape[0] >= floor for buf in after_forward.values())  # every kind: the send floor

    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    assert len(exchange.made) == made, exchange.made[made:]  # nothing allocated in the backward
    assert exchange.buffers.keys() == after_forward.keys()
    assert all(exchange.buffers[kind] is buf for kind, buf in after_forward.items())


def test_the_same_tokens_again_reuse_every_buffer(group):
    exchange = _HostExchange(group)
    x, y = _layer_round_trip(exchange, tokens=50, seed=0)
    y.sum().backward()
    made = len(exchange.made)
    x2, y2 = _layer_round_trip(exchange, tokens=50, seed=1)
    y2.sum().backward()
    torch.testing.assert_close(x2.grad, torch.full_like(x2, 3.0))
    assert len(exchange.made) == made
