"""Settings of one MoE layer, validated once, and their mapping from megatron-core's TransformerConfig."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch.nn.functional as F

# The allowed values and rules live with the run configuration's (config/moe_settings.py, one row
# per setting; config/moe_rules.py), which reports them under YAML keys. The layer's modules import
# the names they use from here.
from megatron_dmoe.config.moe_rules import fused_router_unsupported, option_problems  # noqa: F401
from megatron_dmoe.config.moe_settings import (  # noqa: F401
    AUX_LOSS_TYPES_MEGATRON,
    BLOCK_SIZES,
    BY_OPTION,
    EP_EXCHANGES,
    FP8_MODES,
)


@dataclass
class MoEOptions:
    hidden_size: int
    ffn_hidden_size: int  # width of each expert's MLP
    num_experts: int
    top_k: int = 1
    activation: str = "gelu"  # gelu | swiglu (silu(x w1^T) * (x v1^T))
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = True  # softmax over all experts, then top-k (else top-k of logits, then softmax)
    renormalize: Optional[bool] = None  # top-k weights to sum 1; None = True for sigmoid with top_k > 1
    topk_scaling_factor: float = 1.0
    input_jitter_eps: Optional[float] = None  # router input * U(1-eps, 1+eps) in training
    aux_loss_coeff: float = 0.0  # load-balancing loss; 0 disables it
    z_loss_coeff: float = 0.0  # router z-loss; 0 disables it
    expert_bias: bool = False  # aux-loss-free balancing: a bias that changes the selection only
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None  # None = dropless; a number = token-dropping baseline
    token_drop_policy: str = "probs"  # probs | position
    backend: str = "auto"  # auto | sparse | grouped | reference (auto: sparse on CUDA, reference on CPU)
    block_size: int = 128  # block size of the sparse backend: one of BLOCK_SIZES
    memory_optimized: bool = False  # keep only the expert input and pre-activation; recompute the rest
    ep_exchange: str = "auto"  # expert parallelism: auto | nccl | symmetric (see moe/exchange/)
    init_method_std: float = 0.02
    shared_expert_ffn_hidden_size: int = 0  # width of an MLP every token runs besides its experts; 0 = none
    shared_expert_gate: bool = False  # the shared MLP's output times sigmoid(x . g) per token
    aux_loss_type: str = "micro_batch"  # micro_batch | sequence | global: where expert fractions are counted
    router_num_groups: Optional[int] = None  # group-limited routing: experts in this many equal groups
    router_group_topk: Optional[int] = None  # ... of which each token picks this many, then top_k inside
    router_group_score: str = "sum"  # sum (of each group's best top_k / group_topk; megatron-core) | max
    router_impl: str = "auto"  # auto | fused | torch: see ROUTER_IMPLS (config/moe_settings.py)
    router_dtype: str = "fp32"  # fp32 | fp64: the router's logits, scores, choice and weights
    force_load_balancing: bool = False  # random logits instead of the router's (benchmarks only)
    fp8: Optional[str] = None  # None | "blockwise": the sparse experts' products in block-scaled fp8

    def __post_init__(self):
        problems = option_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(f"MoE option '{field}'={getattr(self, field)!r}: {message}"
                                       for field, message in problems))
        if self.renormalize is None:
            self.renormalize = self.score_function == "sigmoid" and self.top_k > 1

    @classmethod
    def from_transformer_config(cls, config, **overrides) -> "MoEOptions":
        """Read megatron-core's own TransformerConfig MoE fields; `overrides` name MoEOptions fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(
                f"unknown MoE layer option(s) {unknown}; the layer accepts {sorted(names)}"
            )

        def unsupported(field, value, fix):
            raise ValueError(f"TransformerConfig.{field}={value!r} is not supported by this MoE layer; {fix}.")

        if not config.num_moe_experts:
            raise ValueError(
                "TransformerConfig.num_moe_experts is not set; set it (--num-experts) to build an MoE layer."
            )
        balancing = config.moe_router_load_balancing_type
        aux_coeff = config.moe_aux_loss_coeff
        if isinstance(aux_coeff, (list, tuple)):
            unsupported("moe_aux_loss_coeff", aux_coeff, "give one number")
        if balancing not in ("none", *AUX_LOSS_TYPES_MEGATRON):
            unsupported("moe_router_load_balancing_type", balancing,
                        f"use one of: none, {', '.join(AUX_LOSS_TYPES_MEGATRON)}")
        if getattr(config, "moe_shared_expert_overlap", False):
            unsupported("moe_shared_expert_overlap", True, "leave it False (the shared MLP is issued before "
                        "the expert exchange is waited on anyway)")
        # each option from its TransformerConfig field (config/moe_settings.py), converted where
        # megatron-core says it otherwise: None or 0 for "not set", the activation as a function
        read = {s.option: getattr(config, s.megatron, None) for s in BY_OPTION.values() if s.megatron}
        values = dict(
            read,
            ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            activation=_activation_name(config),
            topk_scaling_factor=read["topk_scaling_factor"] or 1.0,
            aux_loss_coeff=0.0 if balancing == "none" else float(aux_coeff or 0.0),
            z_loss_coeff=float(read["z_loss_coeff"] or 0.0),
            shared_expert_ffn_hidden_size=read["shared_expert_ffn_hidden_size"] or 0,
            shared_expert_gate=bool(read["shared_expert_gate"]),
            aux_loss_type=AUX_LOSS_TYPES_MEGATRON.get(balancing, "micro_batch"),
            router_num_groups=read["router_num_groups"] or None,
            router_group_topk=read["router_group_topk"] or None,
            # megatron-core's None computes in the input's dtype; ours never goes below fp32
            router_dtype=read["router_dtype"] or "fp32",
        )
        values.update(overrides)
        return cls(**values)


def _activation_name(config) -> str:
    func, gated = config.activation_func, config.gated_linear_unit
    if func is F.gelu and not gated:
        return "gelu"
    if func is F.silu and gated:
        if getattr(config, "glu_linear_offset", 0.0):
            raise ValueError(
                f"TransformerConfig.glu_linear_offset={config.glu_linear_offset} is not supported by the "
                "MoE experts; leave it at 0."
            )
        return "swiglu"
    name = getattr(func, "__name__", repr(func))
    raise ValueError(
        f"TransformerConfig.activation_func={name} with gated_linear_unit={gated} is not supported by the "
        "MoE experts; use F.gelu without gating (GELU) or F.silu with gated_linear_unit=True (SwiGLU)."
    )
