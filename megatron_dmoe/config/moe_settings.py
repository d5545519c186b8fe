"""Every MoE setting once: its YAML key, megatron-core's TransformerConfig field, Megatron-LM's flag,
the MoE layer's option (MoEOptions field), its allowed values or range, and the layer's default.

Validation (config/validate.py), the Megatron-LM names (config/megatron_names.py), the
TransformerConfig built for a run (model/transformer_config.py), the layer spec's params
(model/gpt.py) and MoEOptions.from_transformer_config (moe/options.py) all read this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .value_text import Limits

ACTIVATIONS = ("gelu", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
BACKENDS = ("auto", "sparse", "grouped", "reference")
BLOCK_SIZES = (16, 32, 64, 128)  # the block-sparse kernels' (dmoe_kernels.products.topology)
EP_EXCHANGES = ("auto", "nccl", "symmetric", "nvshmem")
FP8_MODES = (None, "blockwise")  # training.fp8: the experts' products (moe/experts/products.py)
# what the load-balancing loss's expert fractions are counted over (megatron-core: aux_loss,
# seq_aux_loss, global_aux_loss; see AUX_LOSS_TYPES_MEGATRON)
AUX_LOSS_TYPES = ("micro_batch", "sequence", "global")
# how group-limited routing scores a group: the sum of its best top_k / group_topk scores
# (megatron-core, DeepSeek-V3) or its best score (DeepSeek-V2)
GROUP_SCORES = ("sum", "max")
# how the router's softmax and top-k run: auto (the fused Triton kernels for fp32 CUDA logits where
# the options allow them, else torch), fused (always; an error where they cannot), torch
ROUTER_IMPLS = ("auto", "fused", "torch")
# the precision the router computes in (megatron-core's moe_router_dtype; its None is the input's)
ROUTER_DTYPES = ("fp32", "fp64")
# megatron-core's moe_router_load_balancing_type -> aux_loss_type
AUX_LOSS_TYPES_MEGATRON = {"aux_loss": "micro_batch", "seq_aux_loss": "sequence", "global_aux_loss": "global"}

REQUIRED = object()  # an option without a default (MoEOptions needs it)


@dataclass(frozen=True)
class MoESetting:
    key: str  # YAML key
    option: Optional[str] = None  # MoEOptions field; None: read outside the layer
    # TransformerConfig field; None: the layer gets it as a spec param (an option) or not at all
    megatron: Optional[str] = None
    flag: Optional[str] = None  # Megatron-LM's flag that takes the same value
    choices: Optional[Tuple[Any, ...]] = None
    limits: Optional[Limits] = None  # the range the layer allows
    integer: bool = False  # a number that must be an integer
    default: Any = REQUIRED  # MoEOptions' default
    key_limits: Optional[Limits] = None  # where the YAML key allows more than the layer

    @property
    def yaml_limits(self) -> Optional[Limits]:
        return self.key_limits or self.limits

    @property
    def switch(self) -> bool:
        """A true/false setting (a Megatron-LM flag that takes no value)."""
        return isinstance(self.default, bool)


_AT_LEAST_0 = (0, None, True, None)
_AT_LEAST_1 = (1, None, True, None)
_ABOVE_0 = (0, None, False, None)

MOE_SETTINGS: Tuple[MoESetting, ...] = (
    MoESetting("model.hidden_size", "hidden_size", "hidden_size", "--hidden-size", limits=_AT_LEAST_1,
               integer=True),
    MoESetting("moe.ffn_hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "--moe-ffn-hidden-size",
               limits=_AT_LEAST_1, integer=True),
    # 0 experts: a dense model (no MoE layer is built)
    MoESetting("moe.num_experts", "num_experts", "num_moe_experts", "--num-experts", limits=_AT_LEAST_1,
               integer=True, key_limits=_AT_LEAST_0),
    MoESetting("moe.top_k", "top_k", "moe_router_topk", "--moe-router-topk", limits=_AT_LEAST_1, integer=True,
               default=1),
    # TransformerConfig's activation_func with gated_linear_unit; Megatron-LM's --swiglu
    MoESetting("model.activation", "activation", "activation_func", choices=ACTIVATIONS, default="gelu"),
    MoESetting("moe.router_score_function", "score_function", "moe_router_score_function",
               "--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax"),
    MoESetting("moe.router_pre_softmax", "pre_softmax", "moe_router_pre_softmax", "--moe-router-pre-softmax",
               default=True),
    MoESetting("moe.router_renormalize", "renormalize", default=None),
    MoESetting("moe.router_topk_scaling_factor", "topk_scaling_factor", "moe_router_topk_scaling_factor",
               "--moe-router-topk-scaling-factor", limits=_ABOVE_0, default=1.0),
    MoESetting("moe.input_jitter_eps", "input_jitter_eps", "moe_input_jitter_eps", "--moe-input-jitter-eps",
               limits=(0, 1, True, False), default=None),
    MoESetting("moe.aux_loss_coeff", "aux_loss_coeff", "moe_aux_loss_coeff", "--moe-aux-loss-coeff",
               limits=_AT_LEAST_0, default=0.0),
    MoESetting("moe.z_loss_coeff", "z_loss_coeff", "moe_z_loss_coeff", "--moe-z-loss-coeff", limits=_AT_LEAST_0,
               default=0.0),
    MoESetting("moe.router_enable_expert_bias", "expert_bias", "moe_router_enable_expert_bias",
               "--moe-router-enable-expert-bias", default=False),
    MoESetting("moe.router_bias_update_rate", "bias_update_rate", "moe_router_bias_update_rate",
               "--moe-router-bias-update-rate", limits=_AT_LEAST_0, default=1e-3),
    MoESetting("moe.expert_capacity_factor", "capacity_factor", "moe_expert_capacity_factor",
               "--moe-expert-capacity-factor", limits=_ABOVE_0, default=None),
    MoESetting("moe.token_drop_policy", "token_drop_policy", "moe_token_drop_policy", "--moe-token-drop-policy",
               choices=DROP_POLICIES, default="probs"),
    MoESetting("moe.backend", "backend", choices=BACKENDS, default="auto"),
    MoESetting("moe.block_size", "block_size", choices=BLOCK_SIZES, integer=True, default=128),
    MoESetting("moe.memory_optimized", "memory_optimized", default=False),
    MoESetting("moe.ep_exchange", "ep_exchange", choices=EP_EXCHANGES, default="auto"),
    MoESetting("model.init_method_std", "init_method_std", "init_method_std", "--init-method-std",
               limits=_ABOVE_0, default=0.02),
    MoESetting("moe.shared_expert_ffn_hidden_size", "shared_expert_ffn_hidden_size",
               "moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size",
               limits=_AT_LEAST_0, integer=True, default=0),
    MoESetting("moe.shared_expert_gate", "shared_expert_gate", "moe_shared_expert_gate",
               "--moe-shared-expert-gate", default=False),
    # TransformerConfig's moe_router_load_balancing_type, in its own words (AUX_LOSS_TYPES_MEGATRON)
    MoESetting("moe.aux_loss_type", "aux_loss_type", "moe_router_load_balancing_type", choices=AUX_LOSS_TYPES,
               default="micro_batch"),
    MoESetting("moe.router_num_groups", "router_num_groups", "moe_router_num_groups", "--moe-router-num-groups",
               limits=_AT_LEAST_1, integer=True, default=None),
    MoESetting("moe.router_group_topk", "router_group_topk", "moe_router_group_topk", "--moe-router-group-topk",
               limits=_AT_LEAST_1, integer=True, default=None),
    MoESetting("moe.router_group_score", "router_group_score", choices=GROUP_SCORES, default="sum"),
    MoESetting("moe.router_impl", "router_impl", choices=ROUTER_IMPLS, default="auto"),
    MoESetting("moe.router_dtype", "router_dtype", "moe_router_dtype", "--moe-router-dtype", choices=ROUTER_DTYPES,
               default="fp32"),
    # random router logits (straight-through gradient): evenly loaded experts, for speed measurements
    MoESetting("moe.router_force_load_balancing", "force_load_balancing", "moe_router_force_load_balancing",
               "--moe-router-force-load-balancing", default=False),
    # the experts' products in block-scaled fp8 (moe/experts/products.py); the dense linears read it too
    MoESetting("training.fp8", "fp8", choices=FP8_MODES, default=None),
    # where the MoE layers are: TransformerConfig's moe_layer_freq is the resulting pattern
    MoESetting("moe.layer_freq", megatron="moe_layer_freq", flag="--moe-layer-freq", key_limits=_AT_LEAST_1),
    MoESetting("moe.first_dense_layers", key_limits=_AT_LEAST_0),
    MoESetting("moe.upcycle_granularity", flag="--moe-upcycling-granularity", key_limits=_AT_LEAST_1),
    MoESetting("moe.expert_wgrad_per_step"),
    MoESetting("moe.expert_wgrad_window", key_limits=_AT_LEAST_1),
)

BY_OPTION: Dict[str, MoESetting] = {s.option: s for s in MOE_SETTINGS if s.option}
# MoEOptions field -> YAML key
OPTION_KEYS: Dict[str, str] = {s.option: s.key for s in BY_OPTION.values()}
# the options TransformerConfig has no field for: the MoE layer spec's params
LAYER_PARAMS: Tuple[MoESetting, ...] = tuple(s for s in BY_OPTION.values() if s.megatron is None)


def value_of(cfg, key: str) -> Any:
    """The value of a dotted YAML key in a RunConfig."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)
