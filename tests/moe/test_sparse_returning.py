"""The sparse experts that store their outputs (and, in backward, their input gradients) straight
into the senders' buffers (experts/sparse_returning.py), against a float64 per-token MoE.

The symmetric exchange needs CUDA peers; here it runs over one "rank" whose buffers are plain
tensors (the push kernels write through the same address tables under Triton's interpreter). The
dispatch, the experts and the per-token sum are the layer's own (ExpertParallelDispatcher with
experts_return_rows, ExpertParallelPath); the many-rank index arithmetic is
checked in tests/parallel/test_symmetric_exchange.py, the real exchange on GPUs by the
expert-parallel training tests."""
from types import SimpleNamespace

import pytest
import torch

from megatron_dmoe.moe.exchange.dispatcher import ExpertParallelDispatcher
from megatron_dmoe.moe.exchange.symmetric import SymmetricExchange, _RowsBuffer
from megatron_dmoe.moe.experts.sparse import SparseBackend
from megatron_dmoe.moe.paths.expert_parallel import ExpertParallelPath
from megatron_dmoe.parallel.expert_layout import ExpertLayout
from moe_reference import gelu, rel_err, silu


class _OneRankExchange(SymmetricExchange):
    """SymmetricExchange over one rank with plain tensors for buffers, no barriers."""

    def __init__(self, num_experts):
        self.ranks, self.me, self.local_experts = 1, 0, num_experts
        self.device = torch.device("cpu")
        self.inbox = torch.zeros(1, num_experts, dtype=torch.int32)
        self.inbox_ptrs = torch.tensor([self.inbox.data_ptr()], dtype=torch.int64)
        self.buffers, self.push_programs = {}, 3
        self.barriers = 0

    def barrier(self, channel):
        self.barriers += 1

    def reserve(self, kind, hidden, dtype, rows):
        buf = self.buffer(kind, hidden, dtype)
        if buf is None or buf.capacity < rows:
            tensor = torch.full((rows + 3, hidden), float("nan"), dtype=dtype)  # stale rows must not be read
            buf = _RowsBuffer(tensor, None, torch.tensor([tensor.data_ptr()], dtype=torch.int64))
            self.buffers[(kind, hidden, dtype)] = buf
        return buf


def _reference(x, indices, weights, w1, v1, w2, activation):
    """float64 y[t] = sum_j weights[t, j] * MLP_{indices[t, j]}(x[t])."""
    x, weights = x.double(), weights.double()
    y = torch.zeros_like(x)
    for j in range(indices.shape[1]):
        e = indices[:, j]
        h = torch.einsum("th,tfh->tf", x, w1[e].double())
        if activation == "swiglu":
            a = silu(h) * torch.einsum("th,tfh->tf", x, v1[e].double())
        else:
            a = gelu(h)
        y = y + weights[:, j:j + 1] * torch.einsum("tf,tfh->th", a, w2[e].double())
    return y


@pytest.mark.parametrize("activation,fp8", [("gelu", None), pytest.param("swiglu", None, marks=pytest.mark.slow),
                                            ("gelu", "blockwise")], ids=["gelu", "swiglu", "gelu-fp8"])
def test_outputs_and_gradients_match_a_float64_moe(activation, fp8):
    """fp8: the products in block-scaled fp8 (training.fp8), within the recipe's error and not exact."""
    g = torch.Generator().manual_seed(11 if activation == "gelu" else 12)
    E, f, h, T, k = 3, 32, 32 if fp8 else 24, 21, 2  # fp8 rows of 16-byte multiples
    layout = ExpertLayout(E, f, 1, 0)
    dispatcher = ExpertParallelDispatcher(layout, None, "symmetric", rows_consumed_at_once=True,
                                          experts_return_rows=True)
    exchange = _OneRankExchange(E)
    dispatcher._resolved = exchange
    x = torch.randn(T, h, generator=g, requires_grad=True)
    scores = torch.randn(T, E, generator=g)
    scores[:, 2] = -1e9  # expert 2 receives nothing
    weights, indices = scores.softmax(-1).topk(k, dim=1)
    weights.requires_grad_(True)
    w1 = (torch.randn(E, f, h, generator=g) * h ** -0.5).requires_grad_(True)
    v1 = (torch.randn(E, f, h, generator=g) * h ** -0.5).requires_grad_(True) if activation == "swiglu" else None
    w2 = (torch.randn(E, f, h, generator=g) * f ** -0.5).requires_grad_(True)

    rows, tokens_per_expert, state = dispatcher.dispatch(x, indices, weights)
    assert state.returned_by_experts
    with pytest.raises(RuntimeError, match="sum them with sum_copies"):
        dispatcher.combine(rows, state)
    # as the layer's path runs them
    experts = SimpleNamespace(w1=w1, v1=v1, w2=w2, wgrad_stash=None,
                              options=SimpleNamespace(activation=activation, memory_optimized=False, fp8=fp8))
    path = ExpertParallelPath(dispatcher, SparseBackend(block_size=16))
    y = path.experts_and_combine(SimpleNamespace(experts=experts), rows, tokens_per_expert, state)
    dy = torch.randn(T, h, generator=g)
    params = [x, weights, w1, w2] + ([v1] if v1 is not None else [])
    grads = torch.autograd.grad(y, params, dy)

    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    rx, rweights, rw1, rw2 = ref_params[:4]
    ref = _reference(rx, indices, rweights, rw1, ref_params[4] if v1 is not None else None, rw2, activation)
    ref_grads = torch.autograd.grad(ref, ref_params, dy.double())
    low, high = (1e-4, 0.08) if fp8 else (0, 1e-5)
    assert low <= rel_err(y, ref) < high
    for name, got, want in zip(["x", "weights", "w1", "w2", "v1"], grads, ref_grads):
        assert low <= rel_err(got, want) < high, name
    # plan, dispatch, the experts' stores, and in backward the gradients' pushes and the input gradients' stores
    assert exchange.barriers == 5
