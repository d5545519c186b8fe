"""The dropless MoE layer as a megatron-core module (the `mlp` of a TransformerLayer).

router -> dispatch (permute into expert-grouped rows) -> expert MLPs -> combine (un-permute,
weight, sum over the k experts of each token). With a capacity factor it becomes the
token-dropping baseline: same router, a capacity buffer and batched matmuls.
With shared_expert_ffn_hidden_size, a shared MLP (moe/shared_experts.py) runs on every token and
its output is added; under expert parallelism it runs on a side CUDA stream alongside the exchange.

Under sequence parallelism (tensor-parallel size > 1) each rank routes its own sequence shard, and
the aux losses count the experts' loads over all shards, each rank's share of the loss covering its
own tokens (see `_load_balancing_loss`).

With expert_model_parallel_size > 1 the router stays replicated, each rank holds its share of the
experts, and dispatch/combine exchange rows with the other ranks of its expert-parallel group
(megatron_dmoe.moe.exchange.dispatcher). With expert_tensor_parallel_size > 1 each expert's
FFN is split over that many ranks too, and the exchange spans expert x expert-tensor ranks: every
shard of an expert gets the expert's tokens and the combine adds the shards' partial outputs.

Which of these runs is one object, the layer's `path` (megatron_dmoe.moe.paths), chosen when the
layer is built from its configuration and its weights' device and dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dmoe.parallel.expert_groups import expert_parallel_groups
from megatron_dmoe.parallel.param_roles import mark_sequence_parallel
from megatron_dmoe.parallel.sequence_shards import sequence_shards

from .aux_loss import load_balancing_loss, sequence_load_balancing_loss, z_loss
from .expert_bias import update_expert_biases
from .experts import ExpertMLP
from .options import MoEOptions
from .paths import choose_path
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
        is_mtp_layer: bool = False,  # megatron-core 0.19 passes these two to every MLP; unused here
        name: Optional[str] = None,
        **kwargs,
    ):
        super().__init__(config)
        self.options = opts = MoEOptions.from_transformer_config(config, **kwargs)
        self.layer_number = layer_number
        self.token_dropping = opts.capacity_factor is not None
        # the layers megatron-core's aux-loss tracker indexes (multi-token prediction's included)
        self._tracked_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
        ep_size = getattr(config, "expert_model_parallel_size", 1) or 1
        etp_size = getattr(config, "expert_tensor_parallel_size", 1) or 1
        if (ep_size > 1 or etp_size > 1) and self.token_dropping:
            raise ValueError(
                f"TransformerConfig.moe_expert_capacity_factor={opts.capacity_factor} with "
                f"expert_model_parallel_size={ep_size}, expert_tensor_parallel_size={etp_size}: the token-"
                "dropping baseline runs on whole local experts; set both sizes to 1 or use dropless routing "
                "(capacity factor None)."
            )
        groups = expert_parallel_groups(ep_size, pg_collection, etp_size)
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
        # how the layer runs (moe/paths): chosen here, and again only when the weights move (_apply)
        self.path = choose_path(self)
        self._path_for = (self.experts.w1.device, self.experts.w1.dtype)
        self.use_run_state(run_state if run_state is not None else MoERunState())

    def use_run_state(self, state: MoERunState) -> None:
        """Share `state` (metrics, deferred weight gradients, expert exchanges) with other layers."""
        self.run_state = state
        self.experts.wgrad_stash = state.wgrad
        self.path.use_run_state(state)
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

        return self.path.forward(self, x, valid, b).view(s, b, h), None

    def _apply(self, fn, *args, **kwargs):
        """Moving or casting the weights (.cuda(), .bfloat16(), megatron's Float16Module) may change
        the experts' backend: the path is chosen again then, never per call."""
        out = super()._apply(fn, *args, **kwargs)
        where = (self.experts.w1.device, self.experts.w1.dtype)
        if getattr(self, "_path_for", where) != where:
            self.path = choose_path(self)
            self._path_for = where
            self.path.use_run_state(self.run_state)
        return out

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

    def aux_losses(self, routing: Routing, valid, num_sequences: int) -> Optional[torch.Tensor]:
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
        recorded = record is not None
        # metrics of whole sequences on every shard (they are reduced over data-parallel ranks)
        lb_value, z_value = (None if t is None else shards.total(t) for t in (lb, z))
        metrics.record(
            self.layer_number, lb_loss=None if recorded else lb_value, z_loss=z_value,
            tokens_per_expert=None if recorded else loads,
            num_layers=self._tracked_layers, lb_coeff=opts.aux_loss_coeff, z_coeff=opts.z_loss_coeff,
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
