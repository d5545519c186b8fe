"""The dropless MoE layer as a megatron-core module (the `mlp` of a TransformerLayer).

router -> dispatch (permute into expert-grouped rows) -> expert MLPs -> combine (un-permute,
weight, sum over the k experts of each token). With a capacity factor it becomes the
token-dropping baseline: same router, a capacity buffer and batched matmuls.
With shared_expert_ffn_hidden_size, a shared MLP (moe/shared_experts.py) runs on every token and
its output is added; under expert parallelism it runs on a side CUDA stream alongside the exchange.

Under sequence parallelism (tensor-parallel size > 1) each rank routes its own sequence shard; the
experts are whole on every rank, and the aux losses count the experts' loads over all shards, each
rank's share of the loss covering its own tokens (see `_aux_loss`).

With expert_model_parallel_size > 1 the router stays replicated, each rank holds its share of the
experts, and dispatch/combine exchange rows with the other ranks of its expert-parallel group
(megatron_dmoe.moe.ep_dispatcher).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dmoe.parallel.expert_groups import expert_parallel_groups
from megatron_dmoe.parallel.param_roles import mark_sequence_parallel
from megatron_dmoe.parallel.sequence_shards import sequence_shards

from .aux_loss import AuxLossScaler, load_balancing_loss, sequence_load_balancing_loss, z_loss
from .capacity import CapacityDispatcher
from .dispatcher import DroplessDispatcher, TokenDispatcher
from .expert_bias import update_expert_biases
from .experts import ExpertMLP
from .options import MoEOptions
from .padded_dispatch import PaddedDispatcher, padded_experts_combine
from .router import Routing, TopKRouter
from .run_state import MoERunState
from .shared_experts import SharedExpertMLP


def _param_device(config: TransformerConfig):
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class MoELayer(MegatronModule):
    """forward(hidden_states [s, b, h], padding_mask [b, s] (True = padding) or None) -> (out, None).

    Sizes and router settings come from megatron-core's TransformerConfig (see
    `MoEOptions.from_transformer_config`); keyword arguments (the layer spec's params) override
    MoEOptions fields: backend, block_size, memory_optimized, renormalize, ...
    run_state: the MoERunState the model's MoE layers share (metrics, deferred weight gradients,
    expert exchanges); a state of the layer's own when not given (see `use_run_state`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules=None,
        layer_number: Optional[int] = None,
        pg_collection=None,
        run_state: Optional[MoERunState] = None,
        **kwargs,
    ):
        super().__init__(config)
        self.options = opts = MoEOptions.from_transformer_config(config, **kwargs)
        self.layer_number = layer_number
        self.token_dropping = opts.capacity_factor is not None
        ep_size = getattr(config, "expert_model_parallel_size", 1) or 1
        if ep_size > 1 and self.token_dropping:
            raise ValueError(
                f"TransformerConfig.moe_expert_capacity_factor={opts.capacity_factor} with "
                f"expert_model_parallel_size={ep_size}: the token-dropping baseline runs without expert "
                "parallelism; set expert_model_parallel_size=1 or use dropless routing (capacity factor None)."
            )
        groups = expert_parallel_groups(ep_size, pg_collection)
        device = _param_device(config)
        # the router first: its weights draw from the generator before the experts' at every EP size
        self.router = TopKRouter(opts, dtype=config.params_dtype, device=device)
        self.experts = ExpertMLP(opts, dtype=config.params_dtype, device=device, groups=groups)
        self.shared_experts = None
        if opts.shared_expert_ffn_hidden_size:
            self.shared_experts = SharedExpertMLP(opts, dtype=config.params_dtype, device=device)
            # on a side stream alongside the expert exchange; with every expert here there is none
            self.shared_experts.overlap = groups.size > 1
        # under sequence parallelism each tensor-parallel rank routes its own sequence shard through
        # the replicated router and shared experts: their gradients are summed over those ranks
        self.shards = sequence_shards(config, pg_collection)
        if self.shards.size > 1:
            for module in (self.router, self.shared_experts):
                for param in module.parameters() if module is not None else ():
                    mark_sequence_parallel(param)
        if self.token_dropping:
            self.dispatcher: TokenDispatcher = CapacityDispatcher(
                opts.num_experts, opts.capacity_factor, opts.token_drop_policy
            )
        elif groups.size > 1:
            # imported here: the expert-parallel dispatcher builds on this package's dispatcher
            from megatron_dmoe.moe.ep_dispatcher import ExpertParallelDispatcher

            self.dispatcher = ExpertParallelDispatcher(self.experts.layout, groups.group, opts.ep_exchange)
        else:
            self.dispatcher = DroplessDispatcher(opts.num_experts)
        # the sparse backend on local experts: tokens go straight into its block-padded buffer
        self.padded_dispatcher = PaddedDispatcher(
            opts.num_experts, opts.ffn_hidden_size, opts.block_size,
            strict=opts.backend == "sparse" and groups.size == 1
        )
        self._dispatchers = {}  # (device, dtype) -> the dispatcher for such inputs (see _dispatcher_for)
        self.use_run_state(run_state if run_state is not None else MoERunState())

    def use_run_state(self, state: MoERunState) -> None:
        """Share `state` (metrics, deferred weight gradients, expert exchanges) with other layers."""
        self.run_state = state
        self.experts.wgrad_stash = state.wgrad
        if hasattr(self.dispatcher, "exchanges"):
            self.dispatcher.exchanges = state.exchanges
        if self.layer_number is None or self.layer_number < 0:  # a metrics key unique in this state
            self.layer_number = state.unnumbered_layer()

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, **kwargs):
        h = self.options.hidden_size
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != h:
            raise ValueError(
                f"MoE layer input has shape {tuple(hidden_states.shape)}; expected [seq, batch, {h}] "
                "(hidden_size from the TransformerConfig)."
            )
        s, b, _ = hidden_states.shape
        x = hidden_states.reshape(s * b, h)
        valid = self._valid_tokens(padding_mask, s, b)

        dispatcher = self._dispatcher_for(x)
        if dispatcher is self.padded_dispatcher:
            y = self._padded_forward(x, valid, b)
        else:
            y = self._dispatched_forward(dispatcher, x, valid, b)
        return y.view(s, b, h), None

    def _padded_forward(self, x: torch.Tensor, valid, num_sequences: int) -> torch.Tensor:
        """The sparse backend with every expert here: router, the block-padded plan, and one autograd
        function for the permutation, the experts, the weighted combine and the aux losses' gradient."""
        # the block-padded plan counts every copy anyway: without padding tokens, those are the counts
        routing = self.router(x, valid, count=valid is not None)
        state = self.padded_dispatcher.plan(routing.indices, routing.weights)
        if valid is None:
            routing.tokens_per_expert = state.counts
            self.router.record_load(state.counts)
        aux_loss = self._aux_loss(routing, valid, num_sequences)
        shared = self.shared_experts.start(x) if self.shared_experts is not None else None
        y = padded_experts_combine(self.experts, x, state, aux_loss)
        return y if shared is None else y + self.shared_experts.finish(shared)

    def _dispatched_forward(self, dispatcher: TokenDispatcher, x: torch.Tensor, valid, num_sequences: int):
        """Every other path: router, the dispatcher (dropless, expert-parallel or capacity), the
        experts and the combine, each its own autograd function, the aux losses riding on the
        experts' input."""
        routing = self.router(x, valid)
        x_perm, tokens_per_expert, state = dispatcher.dispatch(x, routing.indices, routing.weights)
        aux_loss = self._aux_loss(routing, valid, num_sequences)
        if aux_loss is not None:
            # the experts' input is not modified in place, so it is returned as is (a view); the
            # layer's output would need a copy (callers add into it in place)
            x_perm = AuxLossScaler.apply(x_perm, aux_loss, False)
        # issued while the dispatch exchange is in flight, before anything waits on its result
        shared = self.shared_experts.start(x) if self.shared_experts is not None else None
        if self.token_dropping:
            y = dispatcher.combine(self.experts.forward_batched(x_perm), state)
        else:
            counts_by_source = dispatcher.counts_by_source(state)
            y = dispatcher.combine(self.experts(x_perm, tokens_per_expert, counts_by_source), state)
        return y if shared is None else y + self.shared_experts.finish(shared)

    def _dispatcher_for(self, x: torch.Tensor) -> TokenDispatcher:
        """The block-padded dispatcher when the sparse backend runs every expert here, else the
        configured one: chosen once per device and dtype, not on every call."""
        key = (x.device, x.dtype)
        chosen = self._dispatchers.get(key)
        if chosen is None:
            sparse = self.experts.backend_for(x).name == "sparse"
            padded = type(self.dispatcher) is DroplessDispatcher and sparse
            chosen = self._dispatchers[key] = (self.padded_dispatcher if padded else self.dispatcher, sparse)
        dispatcher, sparse = chosen
        if dispatcher is self.dispatcher and hasattr(dispatcher, "rows_consumed_at_once"):
            # the sparse experts copy received rows into their padded buffer before anything else runs
            dispatcher.rows_consumed_at_once = sparse
        return dispatcher

    @staticmethod
    def _valid_tokens(padding_mask, s, b):
        """[s*b] bool, False for padding tokens (token order of hidden_states.reshape(s*b, h))."""
        if padding_mask is None:
            return None
        if tuple(padding_mask.shape) != (b, s):
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)}; expected [batch, seq] = {(b, s)} "
                "with True marking padding tokens."
            )
        return (~padding_mask.bool()).transpose(0, 1).reshape(-1)

    def _aux_loss(self, routing: Routing, valid, num_sequences: int) -> Optional[torch.Tensor]:
        """The layer's aux losses summed (None without any), their metrics recorded."""
        # training forwards that build a graph only: eval and the no-grad first pass of activation
        # recompute neither add losses nor record metrics
        if not (self.training and torch.is_grad_enabled()):
            return None
        opts = self.options
        metrics = self.run_state.metrics
        lb = z = None
        # the fused router's loss kernel adds the loss and the loads to our metrics in its own launch;
        # where megatron-core's tracker is written too, `metrics.record` below takes them instead
        record = None
        if (opts.aux_loss_coeff > 0 and opts.aux_loss_type == "micro_batch" and valid is None
                and routing.prob_colsum is not None and not metrics.megatron_tracker and self.shards.size == 1):
            record = metrics.balance_sums(self.layer_number, routing.tokens_per_expert)
        shards, loads = self.shards, routing.tokens_per_expert
        if shards.size > 1:
            if valid is not None:
                raise ValueError("MoE layer: padding masks are not supported with sequence parallelism")
            loads = shards.total(loads)
        if opts.aux_loss_coeff > 0:
            lb = self._load_balancing_loss(routing, loads, valid, num_sequences, record)
        if opts.z_loss_coeff > 0:
            # the mean over this shard's tokens; the shards' shares add up to the whole mean
            z = z_loss(routing.logits, opts.z_loss_coeff / shards.size, valid)
        # megatron-core's tracker too (Megatron-LM logs it), indexed by global layer like its own MoE
        num_layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
        recorded = record is not None
        # metrics of whole sequences on every shard (they are reduced over data-parallel ranks)
        lb_value, z_value = (None if t is None else shards.total(t) for t in (lb, z))
        metrics.record(
            self.layer_number, lb_loss=None if recorded else lb_value, z_loss=z_value,
            tokens_per_expert=None if recorded else loads,
            num_layers=num_layers, lb_coeff=opts.aux_loss_coeff, z_coeff=opts.z_loss_coeff,
        )
        losses = [loss for loss in (lb, z) if loss is not None]
        if not losses:
            return None
        # not sum(losses): its start value 0 would cost one more launch
        return losses[0] if len(losses) == 1 else losses[0] + losses[1]

    def _load_balancing_loss(self, routing: Routing, loads: torch.Tensor, valid, num_sequences: int,
                             record=None) -> torch.Tensor:
        """This rank's share of the loss. Under sequence parallelism (n shards of T tokens each) the
        loads f count all n*T tokens, and the probabilities P this shard's tokens over n*T: the
        shards' shares add up to the loss of whole sequences, and each shard's tokens get exactly
        their gradient of it (megatron-core's router does the same over its tensor group)."""
        opts, n = self.options, self.shards.size
        if opts.aux_loss_type == "sequence":
            return sequence_load_balancing_loss(
                routing.scores, routing.indices, num_sequences, opts.top_k, opts.aux_loss_coeff,
                opts.score_function, valid, shards=self.shards,
            )
        if opts.aux_loss_type == "global":
            scores = routing.scores
            probs = scores if opts.score_function == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
            # its running loads are summed over the tensor and data-parallel ranks already
            return self.router.global_load.loss(probs, routing.tokens_per_expert, opts.top_k,
                                                opts.aux_loss_coeff / n, valid)
        # the fused router summed the probabilities over the valid tokens in its own launch;
        # coeff * E / (k T^2) with T this shard's tokens, so 1 / n^2 makes it the whole count
        return load_balancing_loss(
            routing.scores, loads, opts.top_k, opts.aux_loss_coeff / (n * n),
            opts.score_function, valid, column_sum=routing.prob_colsum, record=record,
        )

    def update_expert_bias(self, group=None) -> None:
        """Apply this layer's aux-loss-free bias update (see `update_expert_biases`)."""
        update_expert_biases(self, group)
