"""Settings of one MoE layer, validated once, and their mapping from megatron-core's TransformerConfig."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch.nn.functional as F

ACTIVATIONS = ("gelu", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
BACKENDS = ("auto", "grouped", "reference", "sparse")
EP_EXCHANGES = ("auto", "nccl", "symmetric")


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
    block_size: int = 128  # block size of the sparse backend
    memory_optimized: bool = False  # keep only the expert input and pre-activation; recompute the rest
    ep_exchange: str = "auto"  # expert parallelism: auto | nccl | symmetric (see parallel/expert_dispatcher.py)
    init_method_std: float = 0.02

    def __post_init__(self):
        def fail(key, problem, fix):
            raise ValueError(f"MoE option '{key}'={getattr(self, key)!r}: {problem}; {fix}.")

        for key in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(key, "must be a positive integer", "set it to a whole number >= 1")
        if self.top_k > self.num_experts:
            fail("top_k", f"exceeds num_experts={self.num_experts}", "route to at most num_experts experts")
        if self.activation not in ACTIVATIONS:
            fail("activation", "is not supported", f"use one of {ACTIVATIONS}")
        if self.score_function not in SCORE_FUNCTIONS:
            fail("score_function", "is not supported", f"use one of {SCORE_FUNCTIONS}")
        if self.top_k == 1 and self.score_function == "softmax" and not self.pre_softmax:
            fail(
                "pre_softmax",
                "with top_k=1 a softmax over the single chosen logit is always 1, so the router gets no gradient",
                "set pre_softmax=True for top-1 routing",
            )
        if self.renormalize is None:
            self.renormalize = self.score_function == "sigmoid" and self.top_k > 1
        if self.renormalize and self.top_k == 1:
            fail(
                "renormalize",
                "with top_k=1 every renormalised weight is 1, so the router gets no gradient from the loss",
                "set renormalize=False for top-1 routing",
            )
        if not (self.topk_scaling_factor > 0 and math.isfinite(self.topk_scaling_factor)):
            fail("topk_scaling_factor", "must be a positive number", "use 1.0 for no scaling")
        if self.input_jitter_eps is not None and not 0.0 <= self.input_jitter_eps < 1.0:
            fail("input_jitter_eps", "must lie in [0, 1)", "use a small value such as 0.01, or None to disable")
        for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                fail(key, "must be a number >= 0", "use 0 to disable it")
        if self.expert_bias and self.score_function != "sigmoid":
            fail("expert_bias", "needs the sigmoid score function", "set score_function='sigmoid'")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            fail("capacity_factor", "must be > 0", "use None for dropless routing")
        if self.token_drop_policy not in DROP_POLICIES:
            fail("token_drop_policy", "is not supported", f"use one of {DROP_POLICIES}")
        if self.backend not in BACKENDS:
            fail("backend", "is not supported", f"use one of {BACKENDS}")
        if self.ep_exchange not in EP_EXCHANGES:
            fail("ep_exchange", "is not supported", f"use one of {EP_EXCHANGES}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            fail("block_size", "must be a power of two >= 16", "use 128 or 64")
        if not self.init_method_std > 0:
            fail("init_method_std", "must be > 0", "use e.g. 0.02")

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
        if balancing not in ("aux_loss", "none"):
            unsupported("moe_router_load_balancing_type", balancing, "use 'aux_loss' or 'none'")
        aux_coeff = config.moe_aux_loss_coeff
        if isinstance(aux_coeff, (list, tuple)):
            unsupported("moe_aux_loss_coeff", aux_coeff, "give one number")
        if getattr(config, "moe_router_num_groups", None):
            unsupported("moe_router_num_groups", config.moe_router_num_groups, "leave group-limited routing off")
        if getattr(config, "moe_shared_expert_intermediate_size", None):
            unsupported(
                "moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size,
                "leave shared experts off",
            )
        values = dict(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            num_experts=config.num_moe_experts,
            top_k=config.moe_router_topk,
            activation=_activation_name(config),
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            topk_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
            input_jitter_eps=config.moe_input_jitter_eps,
            aux_loss_coeff=0.0 if balancing == "none" else float(aux_coeff or 0.0),
            z_loss_coeff=float(config.moe_z_loss_coeff or 0.0),
            expert_bias=config.moe_router_enable_expert_bias,
            bias_update_rate=config.moe_router_bias_update_rate,
            capacity_factor=config.moe_expert_capacity_factor,
            token_drop_policy=config.moe_token_drop_policy,
            init_method_std=config.init_method_std,
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
