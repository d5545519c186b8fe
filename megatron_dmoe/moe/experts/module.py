"""The experts' weights (this rank's share of them) and the module that runs them through the chosen backend."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_dmoe.parallel.expert_groups import ExpertParallelGroups
from megatron_dmoe.parallel.expert_layout import ExpertLayout
from megatron_dmoe.parallel.param_roles import mark_expert_parallel, mark_tensor_parallel

from ..options import MoEOptions
from .backends import check_backend_name, resolve_backend
from .gemm import BatchedGemm
from .mlp import expert_mlp

_LOCAL = ExpertParallelGroups(size=1, rank=0, group=None)


class ExpertMLP(torch.nn.Module):
    """Weights w1, w2 (and v1 for SwiGLU), each [local experts, local ffn, hidden], no biases.

    Expert i computes y = act(x w1[i]^T [, x v1[i]^T]) w2[i]. Without expert parallelism every
    expert is local ([E, ffn, hidden]); with it, this rank holds its share of the global [E, ffn,
    hidden] tensors as `ExpertLayout` describes (whole experts, or one ffn shard of an expert).
    """

    def __init__(
        self,
        options: MoEOptions,
        dtype=torch.float32,
        device=None,
        groups: Optional[ExpertParallelGroups] = None,
    ):
        super().__init__()
        check_backend_name(options.backend)
        self.options = options
        self.groups = groups or _LOCAL
        self.layout = ExpertLayout(options.num_experts, options.ffn_hidden_size, self.groups.size, self.groups.rank,
                                   self.groups.tensor_size)

        def weight():
            w = torch.nn.Parameter(_init_local_share(self.layout, options, dtype, device))
            # Always reduced over the expert-data-parallel group only (megatron's DDP keeps such
            # parameters in a separate buffer). With EP = 1 that group is the data-parallel group,
            # so the gradient is the same; marking them at every EP size keeps the optimizer's
            # parameter groups, and therefore its checkpoints, alike across EP sizes.
            mark_expert_parallel(w)
            if self.groups.tensor_size > 1:
                # its expert-tensor peers hold other ffn shards: each counts in the grad norm
                mark_tensor_parallel(w, dim=1)
            return w

        self.w1 = weight()
        self.v1 = weight() if options.activation == "swiglu" else None
        self.w2 = weight()
        self._backends = {}  # (device, dtype) -> the backend resolved for such inputs
        # the run's WgradStash (moe/run_state.py), set by the layer: where the sparse backend leaves
        # weight-gradient operands when the step defers them
        self.wgrad_stash = None

    def backend_for(self, x: torch.Tensor):
        """The backend for inputs like x, resolved once per device and dtype (not on every call)."""
        key = (x.device, x.dtype)
        backend = self._backends.get(key)
        if backend is None:
            opts = self.options
            backend = resolve_backend(opts.backend, x.device, x.dtype, opts.hidden_size,
                                      self.layout.local_ffn_hidden_size)
            self._backends[key] = backend
        return backend

    def forward(self, x_perm: torch.Tensor, tokens_per_expert: torch.Tensor,
                counts_by_source: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_perm [N, h] grouped by local expert (in order), tokens_per_expert [local experts] -> [N, h].

        With counts_by_source [ranks, local experts], x_perm holds instead one run of expert groups
        per source rank (the expert-parallel exchange's order) and the output keeps that order.
        """
        opts = self.options
        backend = self.backend_for(x_perm)
        if counts_by_source is not None:
            return backend.mlp_in_arrival_order(
                x_perm, counts_by_source, self.w1, self.v1, self.w2, opts.activation, opts.memory_optimized,
                self.wgrad_stash, opts.fp8,
            )
        return backend.mlp(x_perm, tokens_per_expert, self.w1, self.v1, self.w2, opts.activation,
                           opts.memory_optimized, self.wgrad_stash, opts.fp8)

    def forward_batched(self, x_buf: torch.Tensor) -> torch.Tensor:
        """x_buf [E, capacity, h] (the token-dropping baseline) -> [E, capacity, h], by torch.bmm."""
        E, capacity, h = x_buf.shape
        gemm = BatchedGemm(E, capacity)
        y = expert_mlp(
            x_buf.reshape(E * capacity, h), self.w1, self.v1, self.w2, gemm,
            self.options.activation, self.options.memory_optimized,
        )
        return y.view(E, capacity, h)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """ShardedTensors of the GLOBAL [E, ffn, hidden] weights, this rank's share at its place.

        Indexed by global expert id (and ffn shard), so dist_checkpointing can load them at any
        expert-parallel size; one expert-data-parallel replica (replica_id 0) writes each share.
        Optimizer moments follow, as megatron maps optimizer state onto these tensors.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        prepend = len(sharded_offsets)
        offsets = [(prepend + axis, index, count) for axis, index, count in self.layout.global_offsets()]
        replica_id = (0, 0, self.groups.data_parallel_rank())
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", param, *sharded_offsets, *offsets, replica_id=replica_id, prepend_axis_num=prepend
            )
            for name, param in self.named_parameters(recurse=False)
        }


@torch.no_grad()
def _init_local_share(layout: ExpertLayout, options: MoEOptions, dtype, device) -> torch.Tensor:
    """N(0, init_method_std) weights whose GLOBAL values do not depend on the expert-parallel size.

    Every rank draws every expert's full [ffn, hidden] matrix from the same generator, in expert
    order, and keeps its share: the generator's stream, and so everything initialised after the
    experts, is the same at any EP size too. One expert at a time bounds the extra memory.
    """
    hidden, width = options.hidden_size, layout.local_ffn_hidden_size
    local = torch.empty(layout.local_shape(hidden), dtype=dtype, device=device)
    where = {layout.virtual_owner(v): i for i, v in enumerate(layout.local_virtual_experts())}
    full = torch.empty(options.ffn_hidden_size, hidden, dtype=dtype, device=device)
    for expert in range(options.num_experts):
        full.normal_(0.0, options.init_method_std)
        for shard in range(layout.shards_per_expert):
            i = where.get((expert, shard))
            if i is not None:
                local[i].copy_(full[shard * width : (shard + 1) * width])
    return local
