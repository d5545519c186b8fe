"""Which execution path an MoELayer runs, decided from its configuration and its weights' device and
dtype (the experts' backend depends on both)."""
from __future__ import annotations

from ..dispatch.capacity import CapacityDispatcher
from ..dispatch.dropless import DroplessDispatcher
from ..dispatch.padded import PaddedDispatcher
from .base import MoEPath, UnavailablePath
from .capacity import CapacityPath
from .expert_parallel import ExpertParallelPath
from .local_dropless import LocalDroplessPath
from .local_sparse import LocalSparsePath


def choose_path(layer) -> MoEPath:
    """The path for `layer` (an MoELayer whose router, experts and options are built)."""
    opts, experts = layer.options, layer.experts
    groups = experts.groups
    if groups.size == 1:
        # built first: with backend='sparse' a block size that cannot work fails here, at build time
        padded = PaddedDispatcher(opts.num_experts, opts.ffn_hidden_size, opts.block_size,
                                  strict=opts.backend == "sparse")
    if opts.capacity_factor is not None:
        return CapacityPath(CapacityDispatcher(opts.num_experts, opts.capacity_factor, opts.token_drop_policy))
    try:
        backend = experts.backend_for(experts.w1)  # resolved for the weights' device and dtype
    except (ValueError, RuntimeError) as err:
        return UnavailablePath(err)
    sparse = backend.name == "sparse"
    if groups.size > 1:
        # imported here: the expert-parallel dispatcher pulls in the process-group machinery
        from ..exchange.dispatcher import ExpertParallelDispatcher

        # the sparse experts copy received rows into their padded buffer before anything else runs
        dispatcher = ExpertParallelDispatcher(experts.layout, groups.group, opts.ep_exchange,
                                              rows_consumed_at_once=sparse, experts_return_rows=sparse)
        return ExpertParallelPath(dispatcher, backend)
    if sparse:
        return LocalSparsePath(padded)
    return LocalDroplessPath(DroplessDispatcher(opts.num_experts), backend)
