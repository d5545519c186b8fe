"""`sparse` backend: the expert MLP as block-sparse products on the dMoE topology (dmoe_kernels).

Rows come grouped by expert and padded per expert to whole blocks (the padded buffer of
`moe/dispatch/padded.py`); the hidden activation is block-sparse data on the topology built from
the counts on the device. With expert weights viewed as [E*f, h]:

  forward   h1 = SDD(x, w1^T) [, h2 = SDD(x, v1^T)];  a = act(h1 [, h2]);  y = DSD(a, w2)
            (GELU: a from the first SDD's epilogue, no separate pass)
  backward  dw2 = DSD^T(a, dy);  da = SDD(dy, w2^T);  dh = act'(da);
            dx = DSD(dh1, w1) [+ DSD(dh2, v1)];  dw1 = DSD^T(dh1, x) [, dv1 = DSD^T(dh2, x)]

SwiGLU runs two SDDs on the same topology rather than one over [w1; v1] interleaved per expert:
both do the same FLOPs at the same tile shapes, and the interleaved form would need a copy of both
weights every step (2*E*f*h elements read and written) and a split of their gradients.

Weight gradients are added straight into a weight's fp32 `main_grad` (the buffer megatron-core's
DistributedDataParallel gives every parameter) by the DSD^T kernel's epilogue, in one of two ways:
- parameters marked `main_grad_only` (our training wrapper marks them when DDP reduces the whole
  buffer after backward, so no per-parameter hook is needed) enter the autograd function detached
  and their gradient never exists as a tensor: nothing to clone out of a CUDA graph, nothing for a
  hook to add (`_grad_owners`);
- otherwise, megatron-core's gradient-accumulation-fusion convention: the weight is flagged
  `grad_added_to_main_grad`, DDP's hook skips its add and drops the placeholder gradient (eager
  only; see `_weight_grad`).
A caller turns fusion off for one parameter with
`parallel.param_roles.set_fuse_wgrad_accumulation(param, False)`.
Inside the run's `WgradStash.per_step()` (moe/run_state.py), the first way's products are deferred to
the end of the training step and run once over all micro-batches; with a window
(moe.expert_wgrad_window) they run once per window of micro-batches (see per_step_wgrad.py).

Saved for backward: x, the pre-activation(s) and the activation; memory-optimised mode drops the
activation and recomputes it (one element-wise pass) in backward. With weight-gradient windows it
is not kept either: the activation's backward pass recomputes it into its window's slot. Nothing
is copied to the host: every size comes from host-known bounds, counts stay on the device.

  sparse_experts_combine  the layer's path: experts on the padded buffer AND the router-weighted
                          combine in one autograd function (no expert output kept for the
                          router-weight gradient), from the tokens: the permutation into the
                          padded buffer and the aux losses' gradient in it too
  sparse_expert_mlp       the experts alone, padded buffer in and out
  SparseBackend.mlp       the registry's interface: rows grouped by expert without padding, or
                          (mlp_in_arrival_order) as the expert-parallel exchange delivers them,
                          padded and un-padded around sparse_expert_mlp by the fused permutation
                          kernels; over the symmetric exchange the path runs them as
                          sparse_returning.py does instead (outputs pushed from the padded
                          buffer into the senders' buffers)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_dmoe.parallel import param_roles

from ..options import BLOCK_SIZES
from .mlp import ExpertBackend
from .products import products_for

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block_size_for(ffn_hidden_size: int, preferred: int) -> Optional[int]:
    """The largest supported block size <= preferred that divides the expert width, or None."""
    for bs in sorted(BLOCK_SIZES, reverse=True):
        if bs <= preferred and ffn_hidden_size % bs == 0:
            return bs
    return None


@functools.lru_cache(maxsize=None)
def _kernels_importable() -> Optional[str]:
    try:
        import dmoe_kernels  # noqa: F401  (imports triton)
    except ImportError as exc:  # triton ships Linux wheels only
        return f"the block-sparse kernels cannot be imported ({exc})"
    return None


def _interpreter_active() -> bool:
    from dmoe_kernels.launch import interpreted
    from dmoe_kernels.permutation.kernels import permute as permute_kernel

    return interpreted(permute_kernel.reduce_kernel)



def _fusable_main_grad(weight: torch.Tensor, outside_autograd: bool = False) -> Optional[torch.Tensor]:
    """weight.main_grad when the weight gradient may be added into it by the kernel, else None.

    Fused when the weight carries a main_grad of its own shape, contiguous, on its device, in fp32
    or the weight's dtype, unless the parameter says `fuse_wgrad_accumulation = False`. Any other
    main_grad is left to DDP's hook, which adds the returned gradient itself.

    With the flag convention (not outside_autograd), not while a CUDA graph is captured: a replay
    runs no Python, so nothing would set the flag, and megatron's layer graphs restore it only under
    config.gradient_accumulation_fusion (which its own linear layers would then require apex for);
    DDP would add the placeholder.
    """
    main_grad = param_roles.main_grad(weight)
    if main_grad is None or not param_roles.fuses_wgrad_accumulation(weight):
        return None
    if not outside_autograd and weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if (
        main_grad.shape != weight.shape
        or not main_grad.is_contiguous()
        or main_grad.device != weight.device
        or main_grad.dtype not in (torch.float32, weight.dtype)
    ):
        return None
    return main_grad


def _grad_owners(x: torch.Tensor, *weights):
    """(weights to pass to the autograd function, owners): a weight marked `main_grad_only` with a
    fusable main_grad enters detached and is its own owner, whose main_grad the backward adds to;
    any other weight enters as is, owner None. Only when x needs a gradient, so that the backward
    runs at all."""
    fuse = torch.is_grad_enabled() and x.requires_grad
    owners = tuple(
        w if fuse and w is not None and w.requires_grad and param_roles.main_grad_only(w)
        and _fusable_main_grad(w, outside_autograd=True) is not None else None
        for w in weights
    )
    inputs = tuple(w.detach() if o is not None else w for w, o in zip(weights, owners))
    return inputs, owners


def _weight_grad(data, topo, b, weight: torch.Tensor, owner: Optional[torch.Tensor] = None, stash=None):
    """Gradient of an expert weight, S^T @ b for S = (data, topo): added into owner.main_grad
    (returns None: the weight entered detached), or left in `stash` (a WgradStash deferring to the
    step's end, or to its window's end), or else as below. Added means stored when `stash` says
    main_grad still holds the zeros the training loop put there (WgradStash.first_write).

    With a fusable main_grad (see _fusable_main_grad) the product is added into it in the kernel's
    epilogue (fp32 accumulator + old main_grad, one pass), the weight is flagged
    `grad_added_to_main_grad`, and the autograd gradient returned is a placeholder, as in
    megatron-core's gradient-accumulation fusion: uninitialised, which DDP's hook drops unread
    because of the flag; zeros when the parameter asks for `zero_out_wgrad` (the hook then adds it).
    Unfused, a weight with a main_grad gets the flag cleared, so that the hook adds the real
    gradient even after an earlier fused backward (a graph capture, or a toggled opt-out).
    """
    from dmoe_kernels import ops

    E, f, h = weight.shape
    if owner is not None:
        if stash is None or not (stash.stash(owner, data, topo, b) or stash.windowed(owner, data, topo, b)):
            ops.dsd(data, topo, b, transpose=True, out=param_roles.main_grad(owner).view(E * f, h),
                    accumulate=not (stash is not None and stash.first_write(owner)))
        return None
    # the first gradient since the loop zeroed main_grad is stored, not added (read nothing)
    first = stash is not None and stash.first_write(weight)
    main_grad = _fusable_main_grad(weight)
    if main_grad is None:
        if param_roles.main_grad(weight) is not None:
            param_roles.set_grad_added_to_main_grad(weight, False)
        return ops.dsd(data, topo, b, transpose=True).view(E, f, h)
    ops.dsd(data, topo, b, transpose=True, out=main_grad.view(E * f, h), accumulate=not first)
    param_roles.set_grad_added_to_main_grad(weight, True)
    if param_roles.zero_out_wgrad(weight):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def _input_grad(products, d_h1, d_h2, topo, w1, v1, slots=None, dx_targets=None):
    """dx = d_h1 w1 (+ d_h2 v1), d_h1 and d_h2 read from slot `slots[i].counter` of their windows'
    stacked data when slots are given. With dx_targets (RowTargets: other ranks' buffers) dx's
    rows are pushed there from the padded buffer and None is returned."""
    counters = (None, None) if slots is None else tuple(None if s is None else s.counter for s in slots)
    dx = products.input_grad(d_h1, d_h2, topo, w1, v1, counters)
    if dx_targets is None:
        return dx
    dx_targets.push(dx)
    return None


def _up_projection_grads(products, d_h1, d_h2, topo, x, w1, v1, need_x, need_w1, need_v1, owners, stash,
                         dx_targets=None):
    """Gradients through the up-projection(s) h1 = x w1^T (and h2 = x v1^T): dx, dw1, dv1; dx's
    rows pushed to dx_targets instead when given (see _input_grad)."""
    dx = dw1 = dv1 = None
    if need_x:
        dx = _input_grad(products, d_h1, d_h2, topo, w1, v1, dx_targets=dx_targets)
    if need_w1 or owners[0] is not None:
        dw1 = _weight_grad(d_h1, topo, x, w1, owners[0], stash)
    if v1 is not None and (need_v1 or owners[1] is not None):
        dv1 = _weight_grad(d_h2, topo, x, v1, owners[1], stash)
    return dx, dw1, dv1


def _windows_wanted(stash, owners, products) -> bool:
    """Whether every expert weight's gradient may go to a window (moe.expert_wgrad_window; products
    that read the windows' slots): then the backward's activation pass stores the windows' left
    operands itself, and the forward keeps no activation for them."""
    return (products.windows and stash is not None and stash.window > 1 and owners[0] is not None
            and owners[2] is not None)


def _window_slots(ctx, x, h1, v1):
    """(w1's, v1's, w2's WindowSlots; v1's None without v1) when each weight's gradient goes to a
    window, else None."""
    if not _windows_wanted(ctx.stash, ctx.owners, ctx.products) or (v1 is not None and ctx.owners[1] is None):
        return None
    # the down-projection's operands (a, its output gradient) have the up-projection's shapes
    slots = tuple(None if o is None else ctx.stash.window_slots(o, h1, ctx.topology, x) for o in ctx.owners)
    if any(s is None for s, o in zip(slots, ctx.owners) if o is not None):
        return None
    return slots


def _windowed_backward(ctx, x, w1, v1, w2, slots, output_grad_rows, unweighted_grad_rows, activation_backward,
                       dx_targets=None):
    """_expert_mlp_backward with every weight gradient going to a window (slots: w1's, v1's, w2's
    WindowSlots): the activation's backward stores a, d_h1 (and d_h2) into the windows' slots and
    nowhere else, dx reads d_h1 (and d_h2) there, and only x (and g_out where its producer cannot
    write it into w2's slot itself: output_grad_rows(slot) returns None when it did) is copied into
    its slot. -> (dx, None, None, None)."""
    topo, owners, stash = ctx.topology, ctx.owners, ctx.stash
    w1_slots, v1_slots, w2_slots = slots
    g_out = output_grad_rows(w2_slots.b_slot)  # None: written into w2's slot by its producer
    da = ctx.products.output_grad(unweighted_grad_rows(), topo, w2)
    activation_backward(da, (w2_slots.data_slot, w1_slots.data_slot, None if v1_slots is None else v1_slots.data_slot))
    del da
    stash.windowed(owners[2], None, topo, g_out)
    del g_out
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _input_grad(ctx.products, w1_slots.data, None if v1_slots is None else v1_slots.data, topo, w1, v1,
                         (w1_slots, v1_slots), dx_targets)
    for owner in owners[:2]:
        if owner is not None:
            stash.windowed(owner, None, topo, x)
    return dx, None, None, None


def _expert_mlp_backward(ctx, saved, output_grad_rows, unweighted_grad_rows, activation_backward, dx_targets=None):
    """The backward the autograd functions share, from the first seven saved tensors (x, w1, v1,
    w2, h1, h2, a) -> (dx over the padded rows, dw1, dv1, dw2); dx None when its rows go to
    dx_targets (RowTargets: another rank's buffers):

      dw2 = DSD^T(a, g_out)      a recomputed when not kept; g_out = output_grad_rows(), called
                                 only when dw2 is needed (output_grad_rows(slot): the same rows
                                 written into a window's slot (stacked, counter) where the producer
                                 can, then None; else returned)
      da  = SDD(g, w2^T)         g = unweighted_grad_rows()
      d_h1, d_h2 = activation_backward(da, None)   (d_h1 may overwrite da)
      dx, dw1, dv1 through the up-projection(s)

    With weight-gradient windows: _windowed_backward.
    """
    from dmoe_kernels import activation as act

    x, w1, v1, w2, h1, h2, a = saved
    slots = _window_slots(ctx, x, h1, v1)
    if slots is not None:
        return _windowed_backward(ctx, x, w1, v1, w2, slots, output_grad_rows, unweighted_grad_rows,
                                  activation_backward, dx_targets)
    topo, owners = ctx.topology, ctx.owners
    need_x, need_w1, need_v1, need_w2 = ctx.needs_input_grad[:4]
    dw2 = None
    if need_w2 or owners[2] is not None:
        if a is None:  # memory-optimised (or windows that could not be made): recompute the activation
            a = act.activation_forward(ctx.activation, h1, h2, topo.nnz)
        dw2 = _weight_grad(a, topo, output_grad_rows(), w2, owners[2], ctx.stash)
    del a
    da = ctx.products.output_grad(unweighted_grad_rows(), topo, w2)
    d_h1, d_h2 = activation_backward(da, None)
    dx, dw1, dv1 = _up_projection_grads(ctx.products, d_h1, d_h2, topo, x, w1, v1, need_x, need_w1, need_v1, owners,
                                        ctx.stash, dx_targets)
    return dx, dw1, dv1, dw2


class _SparseExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, v1, w2, topology, activation, memory_optimized, owners, stash, fp8):
        products = products_for(fp8)
        h1, h2, a = products.hidden(x, w1, v1, topology, activation)
        y = products.down(a, topology, w2)
        keep_a = not (memory_optimized or _windows_wanted(stash, owners, products))
        ctx.save_for_backward(x, w1, v1, w2, h1, h2, a if keep_a else None)
        ctx.topology, ctx.activation, ctx.owners, ctx.stash = topology, activation, owners, stash
        ctx.products = products
        return y

    @staticmethod
    def backward(ctx, dy):
        from dmoe_kernels import activation as act
        from dmoe_kernels.launch import bind_device

        bind_device(dy)
        dy = dy.contiguous()
        nnz = ctx.topology.nnz
        h1, h2 = ctx.saved_tensors[4:6]
        dx, dw1, dv1, dw2 = _expert_mlp_backward(
            ctx, ctx.saved_tensors, lambda slot=None: dy, lambda: dy,
            lambda da, slots: act.activation_backward(ctx.activation, da, h1, h2, nnz, slots, keep=slots is None),
        )
        return dx, dw1, dv1, dw2, None, None, None, None, None, None


def sparse_expert_mlp(x_pad, w1, v1, w2, topology, activation: str, memory_optimized: bool = False,
                      wgrad_stash=None, fp8: Optional[str] = None) -> torch.Tensor:
    """x_pad [rows, h] (the padded buffer of `topology`); w1, v1 (SwiGLU only), w2 [E, f, h] -> [rows, h].
    wgrad_stash: the run's WgradStash (weight gradients deferred to the step's end inside its block).
    fp8: None, or "blockwise" for the block-scaled fp8 products (products.py).

    Rows past the used ones come out zero; padding rows of x_pad must be zero (the permutation
    writes them so), which keeps them out of the weight gradients.
    """
    E, f, _ = w1.shape
    if topology.shape != (x_pad.shape[0], E * f):
        raise ValueError(
            f"the topology is {topology.shape} but the experts need [{x_pad.shape[0]} rows, {E} experts x "
            f"{f} ffn]; build it from this layer's counts with ffn_hidden_size={f}"
        )
    (w1, v1, w2), owners = _grad_owners(x_pad, w1, v1, w2)
    return _SparseExpertMLP.apply(x_pad, w1, v1, w2, topology, activation, memory_optimized, owners, wgrad_stash,
                                  fp8)


class _SparseExpertsCombine(torch.autograd.Function):
    """The expert MLP and the weighted combine y[t] = sum_j weights[t, j] * y_pad[pos[t, j]] in one
    function, so that the router-weight gradient needs no saved expert output: with dy_u the
    unweighted copies of dy and da_u = SDD(dy_u, w2^T), <dy[t], y_pad[p]> = <da_u[p], a[p]>,
    summed in the activation's backward pass. Saved: x, pre-activation(s), activation (unless
    memory_optimized), positions and weights; as a dense MLP keeps x, h and act(h).

    Its input is the layer's tokens [T, h], copied into the padded buffer here (and dx summed back
    from it in backward, the router-weight gradient gathered in the same launch), so that the
    layer's routed path is one autograd node instead of three. aux_loss: a loss that gets its
    gradient from megatron-core's scale in this backward (what AuxLossScaler would give it)."""

    @staticmethod
    def forward(ctx, x, w1, v1, w2, weights, aux_loss, topology, positions, counts, activation, memory_optimized,
                owners, stash, fp8):
        from dmoe_kernels.permutation.ops import expand, reduce

        products = products_for(fp8)
        x_pad = expand(x, positions, topology.shape[0], topology.expert_offsets, counts)
        h1, h2, a = products.hidden(x_pad, w1, v1, topology, activation)
        y = reduce(products.down(a, topology, w2), positions, weights)
        keep_a = not (memory_optimized or _windows_wanted(stash, owners, products))
        ctx.save_for_backward(x_pad, w1, v1, w2, h1, h2, a if keep_a else None, weights, positions,
                              counts, aux_loss)
        ctx.topology, ctx.activation, ctx.owners, ctx.stash = topology, activation, owners, stash
        ctx.products = products
        return y

    @staticmethod
    def backward(ctx, dy):
        from dmoe_kernels import activation as act
        from dmoe_kernels.launch import bind_device
        from dmoe_kernels.permutation.ops import expand, reduce

        from ..aux_loss import aux_loss_gradient

        saved = ctx.saved_tensors
        h1, h2 = saved[4:6]
        weights, positions, counts, aux_loss = saved[7:]
        topo = ctx.topology
        rows, offsets = topo.shape[0], topo.expert_offsets
        bind_device(dy)
        need_weights = ctx.needs_input_grad[4]
        # each padded row's router weight (0 on padding rows), for the activation's backward
        row_weights = torch.empty(rows, dtype=weights.dtype, device=weights.device)
        row_weights_written = []

        def weighted_grad_rows(slot=None):  # the weighted copies of dy write the row weights in the same launch
            row_weights_written.append(True)
            stacked, index = slot if slot is not None else (None, None)
            return expand(dy, positions, rows, offsets, counts, scale=weights, scale_rows=row_weights,
                          out=stacked, slot=index)

        row_dot = []

        def activation_backward(da, slots):
            if not row_weights_written:
                row_weights.zero_().index_put_((positions.reshape(-1),), weights.reshape(-1))
            # the activation is recomputed here for the router-weight gradient
            d_h1, d_h2, dot = act.activation_backward_weighted(ctx.activation, da, h1, h2, row_weights, topo,
                                                               slots, keep=slots is None)
            row_dot.append(dot)
            return d_h1, d_h2

        dx, dw1, dv1, dw2 = _expert_mlp_backward(
            ctx, saved[:7], weighted_grad_rows, lambda: expand(dy, positions, rows, offsets, counts),
            activation_backward,
        )
        row_dot = row_dot[0]
        d_weights = None
        if dx is not None:  # back to token order; the router-weight gradient in the same launch
            if need_weights:
                dx, d_weights = reduce(dx, positions, partials=row_dot)
            else:
                dx = reduce(dx, positions)
        elif need_weights:  # each copy's partial dots (one per column block), gathered by int32 row and summed
            d_weights = row_dot.index_select(0, positions.reshape(-1)).view(*positions.shape, -1).sum(-1)
        if d_weights is not None:
            d_weights = d_weights.to(weights.dtype)
        d_aux = aux_loss_gradient(aux_loss) if aux_loss is not None and ctx.needs_input_grad[5] else None
        return dx, dw1, dv1, dw2, d_weights, d_aux, None, None, None, None, None, None, None, None


def sparse_experts_combine(x, w1, v1, w2, weights, topology, positions, counts, activation: str,
                           memory_optimized: bool = False, wgrad_stash=None, aux_loss=None,
                           fp8: Optional[str] = None) -> torch.Tensor:
    """y [T, h] = sum_j weights[t, j] * MLP(x_pad)[positions[t, j]] for the tokens x [T, h]: their
    permutation into the padded buffer x_pad, the experts on it and the weighted combine in one
    autograd function (see _SparseExpertsCombine). aux_loss: a 0-dim loss whose gradient is
    megatron-core's aux-loss scale (see AuxLossScaler). fp8: None or "blockwise" (products.py)."""
    E, f, _ = w1.shape
    if topology.shape[1] != E * f or not topology.blocks_per_row:
        raise ValueError(
            f"the topology is {topology.shape} but the experts need the dMoE topology of [padded rows, {E} "
            f"experts x {f} ffn]; build it with Topology.for_experts from this layer's counts"
        )
    (w1, v1, w2), owners = _grad_owners(x, w1, v1, w2)
    return _SparseExpertsCombine.apply(
        x, w1, v1, w2, weights, aux_loss, topology, positions, counts, activation, memory_optimized, owners,
        wgrad_stash, fp8
    )


class SparseBackend(ExpertBackend):
    name = "sparse"

    def __init__(self, block_size: int = 128):
        self.block_size = block_size

    def unsupported_reason(self, device, dtype, hidden_size, ffn_hidden_size):
        reason = _kernels_importable()
        if reason is not None:
            return reason
        device = torch.device(device)
        if dtype not in SUPPORTED_DTYPES:
            return f"the block-sparse kernels take float32, float16 or bfloat16, not {dtype}"
        if device.type == "cpu":
            if not _interpreter_active():
                return ("the block-sparse kernels need CUDA; on CPU they run only under Triton's interpreter "
                        "(TRITON_INTERPRET=1 set before triton is first imported)")
            if dtype == torch.bfloat16:
                return "Triton's interpreter computes wrong bfloat16 products on CPU; use float32 or float16"
        elif device.type != "cuda":
            return f"the block-sparse kernels run on CUDA (or on CPU under Triton's interpreter), not {device.type}"
        if block_size_for(ffn_hidden_size, self.block_size) is None:
            return f"ffn_hidden_size={ffn_hidden_size} is not a multiple of {min(BLOCK_SIZES)}, the smallest block size"
        return None

    def mlp(self, x, tokens_per_expert, w1, v1, w2, activation, memory_optimized, wgrad_stash=None, fp8=None):
        """Rows grouped by expert WITHOUT padding: copied into a padded buffer and back by the fused
        permutation kernels. The layer without expert parallelism permutes straight into the
        padded buffer instead (moe/dispatch/padded.py)."""
        return self.mlp_in_arrival_order(x, tokens_per_expert.view(1, -1), w1, v1, w2, activation, memory_optimized,
                                         wgrad_stash, fp8)

    def mlp_in_arrival_order(self, x, counts_by_source, w1, v1, w2, activation, memory_optimized, wgrad_stash=None,
                             fp8=None):
        """Rows as the expert-parallel exchange delivers them (runs of expert groups, one per source
        rank): one kernel writes each row to its expert's block-padded group, one brings the
        outputs back in arrival order. A device-side exchange delivers a buffer of a bound's size
        whose real rows come first: both kernels (and their backwards) skip the rest."""
        import dmoe_kernels as dk
        from dmoe_kernels.permutation.functional import permute, unpermute

        from .arrival import arrival_positions

        num_rows, f = x.shape[0], w1.shape[1]
        tokens_per_expert = counts_by_source.sum(0)
        topo = dk.Topology.for_experts(tokens_per_expert, num_rows, f, block_size_for(f, self.block_size))
        pos = arrival_positions(counts_by_source, topo.expert_offsets, num_rows)
        real_rows = tokens_per_expert.sum().reshape(1)
        x_pad = permute(x, pos, topo.shape[0], topo.expert_offsets, tokens_per_expert, valid_rows=real_rows)
        y_pad = sparse_expert_mlp(x_pad, w1, v1, w2, topo, activation, memory_optimized, wgrad_stash, fp8)
        return unpermute(y_pad, pos, topo.expert_offsets, tokens_per_expert, valid_rows=real_rows)
