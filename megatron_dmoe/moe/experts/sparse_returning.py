"""The sparse experts between the symmetric exchange's pushes, their outputs pushed from the
padded buffer straight into the senders' buffers (moe/exchange/symmetric.py).

Unfused, the rows pass three times after the experts' last product: the product stores the padded
output, one pass brings it back to arrival order, one push stores it into the senders' `to_sources`
buffers; the backward does the same with the input gradient. Here one push reads the padded rows
and stores each at its sender's row (`RowTargets`, from `return_targets`), so the un-permutation
pass and its backward's counterpart do not run:

  forward   arrival rows -> padded buffer (expand) -> h1 [, h2] -> a -> DSD(a, w2) -> pushed into
            the senders' to_sources -> barrier; returns this rank's to_sources view (its copies'
            outputs, in its sorted order), which the dispatcher sums per token
  backward  the gradient of that view goes out to the expert ranks (to_experts push, barrier) ->
            padded (expand) -> the experts' backward, dx pushed into the senders' to_sources ->
            barrier. The gradient returned for the received rows is a placeholder: the dispatch's
            backward reads its rows from to_sources (`send_to_experts(..., returned=True)`).

The products could store the rows to the peers themselves (a scattering epilogue): measured, that
made them slower than the pass it saves (docs/archive/moe_notes.md, "The combine pushed from the padded
buffer").
"""
from __future__ import annotations

import torch

from .products import products_for
from .sparse import _expert_mlp_backward, _grad_owners, _windows_wanted, block_size_for


class _SparseExpertsReturning(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, v1, w2, exchange, plan, activation, memory_optimized, owners, stash, block_size, fp8):
        import dmoe_kernels as dk
        from dmoe_kernels.exchange.ops import RowTargets, return_targets
        from dmoe_kernels.permutation.ops import expand

        from .arrival import arrival_positions

        f, h = w1.shape[1:]
        products = products_for(fp8)
        num_rows = x.shape[0]
        tokens_per_expert = plan.tokens_per_expert
        topo = dk.Topology.for_experts(tokens_per_expert, num_rows, f, block_size_for(f, block_size))
        pos = arrival_positions(plan.counts_by_source, topo.expert_offsets, num_rows)
        real_rows = tokens_per_expert.sum().reshape(1)
        x_pad = expand(x, pos, topo.shape[0], topo.expert_offsets, tokens_per_expert, valid_rows=real_rows)
        h1, h2, a = products.hidden(x_pad, w1, v1, topo, activation)
        to_sources = exchange.buffer("to_sources", h, x.dtype)  # reserved by the dispatch
        # the padded rows end with the last expert's group: the push stops there
        targets = RowTargets(return_targets(pos, plan, topo.shape[0]), to_sources.ptrs, topo.expert_offsets[-1:])
        targets.push(products.down(a, topo, w2))
        exchange.barrier(channel=1)
        keep_a = not (memory_optimized or _windows_wanted(stash, owners, products))
        ctx.save_for_backward(x_pad, w1, v1, w2, h1, h2, a if keep_a else None, pos, real_rows, targets.targets)
        ctx.topology, ctx.activation, ctx.owners, ctx.stash = topo, activation, owners, stash
        ctx.products = products
        ctx.exchange, ctx.plan, ctx.received_shape = exchange, plan, x.shape
        return exchange.returned_rows(h, x.dtype, plan)

    @staticmethod
    def backward(ctx, grad):
        from dmoe_kernels import activation as act
        from dmoe_kernels.exchange.ops import RowTargets
        from dmoe_kernels.launch import bind_device
        from dmoe_kernels.permutation.ops import expand

        bind_device(grad)  # autograd's worker thread
        saved = ctx.saved_tensors
        h1, h2 = saved[4:6]
        pos, real_rows, targets = saved[7:]
        topo, exchange, plan = ctx.topology, ctx.exchange, ctx.plan
        dx_targets = RowTargets(targets, exchange.buffer("to_sources", grad.shape[1], grad.dtype).ptrs,
                                topo.expert_offsets[-1:])
        arrived = exchange.to_experts(grad.contiguous(), plan)
        dy = expand(arrived, pos, topo.shape[0], topo.expert_offsets, plan.tokens_per_expert, valid_rows=real_rows)
        _, dw1, dv1, dw2 = _expert_mlp_backward(
            ctx, saved[:7], lambda slot=None: dy, lambda: dy,
            lambda da, slots: act.activation_backward(ctx.activation, da, h1, h2, topo.nnz, slots, keep=slots is None),
            dx_targets=dx_targets,
        )
        exchange.barrier(channel=1)
        # the received rows' gradient is in the senders' to_sources now: a placeholder of its shape,
        # never read (no kernel fills it)
        placeholder = grad.new_empty(()).expand(ctx.received_shape)
        return placeholder, dw1, dv1, dw2, None, None, None, None, None, None, None, None


def sparse_experts_returning(x, w1, v1, w2, exchange, plan, activation: str, memory_optimized: bool = False,
                             wgrad_stash=None, block_size: int = 128, fp8=None) -> torch.Tensor:
    """x: the received rows (the to_experts view a symmetric dispatch returns, arrival order), the
    plan of that dispatch -> this rank's to_sources view [plan.send_rows, h]: its routed copies'
    expert outputs in its sorted order (what `SymmetricExchange.to_sources` would deliver)."""
    (w1, v1, w2), owners = _grad_owners(x, w1, v1, w2)
    return _SparseExpertsReturning.apply(x, w1, v1, w2, exchange, plan, activation, memory_optimized, owners,
                                         wgrad_stash, block_size, fp8)
