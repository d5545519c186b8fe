"""megatron-core layer specs whose MLP is our MoE layer.

We start from megatron-core's own GPT layer specs (local modules, or Transformer Engine's where it is
importable and asked for) and change these slots: the MLP of MoE layers becomes
`megatron_dmoe.moe.MoELayer`; without Transformer Engine, core attention becomes `SDPAttention`
(torch's fused kernels) unless megatron's unfused attention is asked for, the norms that would
be torch's (no apex) become our Triton `FusedNorm`, and the linear layers add their bias inside the
matmul at tensor-parallel size 1 (`model/linear.py`).

`dmoe_layer_spec` is a ready object for Megatron-LM's `pretrain_gpt.py --spec
megatron_dmoe.model.spec dmoe_layer_spec` (it imports the name and does not call it): a
TransformerLayer with our MoE MLP in every layer, sized at build time from the TransformerConfig that
Megatron-LM's flags produce (--num-experts, --moe-router-topk, ...).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dmoe.compat import mcore as mcore_compat
from megatron_dmoe.compat.block_final_norm import use_for_block_final_norm
from megatron_dmoe.compat.mla_without_te import allow_mla_without_te
from megatron_dmoe.config.moe_layers import moe_layer_pattern
from megatron_dmoe.model.attention import ProjectionQKNorm, SDPAttention
from megatron_dmoe.model.layer_seed import seeded_layer_class
from megatron_dmoe.model.linear import Fp8ColumnLinear, Fp8RowLinear, FusedBiasColumnLinear, FusedBiasRowLinear
from megatron_dmoe.model.norm import FusedNorm
from megatron_dmoe.moe.layer import MoELayer
from megatron_dmoe.moe.run_state import MoERunState

CORE_ATTENTIONS = ("sdpa", "unfused")
# model.qk_layernorm_scope: megatron's per-head norm of queries and keys, or ours over the projection
QK_NORM_SCOPES = ("head", "projection")


class _OwnMLPNotice(logging.Filter):
    """megatron's TransformerLayer logs 'Unknown MLP type' once per layer for any MLP class it did
    not write; for ours that is expected (it needs none of the extra arguments), so drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_OwnMLPNotice())


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _with_submodule(spec: ModuleSpec, **changes) -> ModuleSpec:
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


_FUSED_BIAS = {ColumnParallelLinear: FusedBiasColumnLinear, RowParallelLinear: FusedBiasRowLinear}
_FP8 = {ColumnParallelLinear: Fp8ColumnLinear, RowParallelLinear: Fp8RowLinear}


def _swap_linears(spec: ModuleSpec, names, classes) -> ModuleSpec:
    changes = {n: classes[getattr(spec.submodules, n)] for n in names
               if getattr(spec.submodules, n, None) in classes}
    return _with_submodule(spec, **changes) if changes else spec


def _with_fused_bias_linears(spec: ModuleSpec, fp8: Optional[str] = None) -> ModuleSpec:
    """megatron's local linear layers in attention and the dense MLP -> model/linear.py's, in fp8 with
    training.fp8 (multi-latent attention's projections have no biases but its output's, and it
    accepts only megatron's classes for its down projections)."""
    classes = _FP8 if fp8 else _FUSED_BIAS
    sub = spec.submodules
    changes = {"self_attention": _swap_linears(sub.self_attention, ("linear_qkv", "linear_proj"), classes)}
    mlp = mcore_compat.mlp_spec_submodules(sub.mlp)  # the dense MLP's (an MoE layer has none)
    if mlp is not None:
        swapped = {n: classes[getattr(mlp, n)] for n in ("linear_fc1", "linear_fc2")
                   if getattr(mlp, n, None) in classes}
        changes["mlp"] = mcore_compat.with_mlp_spec_submodules(sub.mlp, dataclasses.replace(mlp, **swapped))
    return _with_submodule(spec, **changes)


def _with_fused_norms(spec: ModuleSpec) -> ModuleSpec:
    """Our Triton norms in the slots where megatron's local spec falls back to torch's (no apex),
    the per-head query/key norms included (torch's refuses sequence parallelism; ours marks its
    weight so that megatron-core sums its gradient over the tensor-parallel ranks, whose heads differ)."""
    names = [n for n in ("input_layernorm", "pre_mlp_layernorm") if getattr(spec.submodules, n) is WrappedTorchNorm]
    attention = spec.submodules.self_attention
    qk = [n for n in ("q_layernorm", "k_layernorm", "kv_layernorm")
          if getattr(attention.submodules, n, None) is WrappedTorchNorm]
    if qk:
        spec = _with_submodule(spec, self_attention=_with_submodule(attention, **{n: FusedNorm for n in qk}))
    return _with_submodule(spec, **{n: FusedNorm for n in names}) if names else spec


def _with_projection_qk_norms(spec: ModuleSpec) -> ModuleSpec:
    """The q_layernorm / k_layernorm slots (megatron's per-head norms) -> ProjectionQKNorm."""
    attention = spec.submodules.self_attention
    norms = {name: ModuleSpec(module=ProjectionQKNorm, params={"heads": heads})
             for name, heads in (("q_layernorm", "query"), ("k_layernorm", "key"))}
    return _with_submodule(spec, self_attention=_with_submodule(attention, **norms))


def moe_mlp_spec(moe_params: Optional[dict] = None) -> ModuleSpec:
    """Our MoE layer as an `mlp` slot; `moe_params` carries settings megatron has no field for.
    Every layer built from the spec shares its `run_state` (a new MoERunState unless given)."""
    params = dict(moe_params or {})
    params.setdefault("run_state", MoERunState())
    return ModuleSpec(module=MoELayer, params=params)


def layer_spec(
    *,
    moe: bool,
    normalization: str = "LayerNorm",
    use_transformer_engine: bool = False,
    core_attention: str = "sdpa",
    moe_params: Optional[dict] = None,
    attention_recompute: bool = False,
    qk_layernorm: Optional[str] = None,
    multi_latent_attention: bool = False,
    fp8: Optional[str] = None,
) -> ModuleSpec:
    """One TransformerLayer spec: dense (megatron's MLP) or MoE (ours). attention_recompute: SDPA's
    own selective recompute (model/attention.py), where megatron's is switched off. qk_layernorm:
    None, or a norm of the queries and keys per "head" (megatron's) or over the "projection"; with
    multi_latent_attention (megatron-core's MLA, local modules only) "head" norms its latents.
    fp8: None, or "blockwise" for attention's and the dense MLP's linears in block-scaled fp8 (local
    modules; the MoE layer takes its own fp8 setting from moe_params)."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention must be one of {CORE_ATTENTIONS}, got {core_attention!r}")
    if qk_layernorm not in (None, *QK_NORM_SCOPES):
        raise ValueError(f"qk_layernorm must be None or one of {QK_NORM_SCOPES}, got {qk_layernorm!r}")
    # Asking megatron for an MoE layer gives the right pre-MLP norm (TE fuses it into fc1 otherwise);
    # 2 is a placeholder: we replace the MLP it would build.
    num_experts = 2 if moe else None
    qk = qk_layernorm is not None
    if use_transformer_engine and multi_latent_attention:
        raise ValueError("multi-latent attention is built from megatron-core's local modules only")
    if fp8 and (use_transformer_engine or multi_latent_attention):
        raise ValueError("fp8 linears are built into megatron-core's local modules, without multi-latent attention")
    if use_transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk)
    else:
        spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization, qk_layernorm=qk,
                                        multi_latent_attention=multi_latent_attention)
        if multi_latent_attention:
            allow_mla_without_te()
            spec = _with_submodule(spec, self_attention=dataclasses.replace(
                spec.submodules.self_attention, module=mcore_compat.local_mla_self_attention()))
        spec = _with_fused_bias_linears(_with_fused_norms(spec), fp8)
        if core_attention == "sdpa":
            attention = spec.submodules.self_attention
            core = ModuleSpec(module=SDPAttention, params={"recompute": attention_recompute})
            spec = _with_submodule(spec, self_attention=_with_submodule(attention, core_attention=core))
    if qk_layernorm == "projection":
        spec = _with_projection_qk_norms(spec)
    if moe:
        spec = _with_submodule(spec, mlp=moe_mlp_spec(moe_params))
    return spec


def config_moe_layers(config: TransformerConfig) -> List[bool]:
    """Which layers (0-based, whole model) carry an MoE MLP, by megatron-core's moe_layer_freq."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return moe_layer_pattern(config.num_layers, freq)
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq lists {len(freq)} layers but the model has {config.num_layers}")
    return [bool(x) for x in freq]


def block_spec(
    config: TransformerConfig,
    *,
    normalization: str = "LayerNorm",
    use_transformer_engine: bool = False,
    core_attention: str = "sdpa",
    moe_params: Optional[dict] = None,
    vp_stage: Optional[int] = None,
    attention_recompute: bool = False,
    qk_layernorm: Optional[str] = None,
    multi_latent_attention: bool = False,
    fp8: Optional[str] = None,
) -> TransformerBlockSubmodules:
    """Layer-by-layer specs for this pipeline stage, MoE where `config_moe_layers` says."""
    kinds = {
        moe: layer_spec(
            moe=moe,
            normalization=normalization,
            use_transformer_engine=use_transformer_engine,
            core_attention=core_attention,
            moe_params=moe_params,
            attention_recompute=attention_recompute,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
            fp8=fp8,
        )
        for moe in (False, True)
    }
    # the same initial weights at any pipeline layout (model/layer_seed.py)
    kinds = {moe: dataclasses.replace(spec, module=seeded_layer_class(spec.module)) for moe, spec in kinds.items()}
    pattern = config_moe_layers(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    local = [kinds[is_moe] for is_moe in pattern[offset : offset + count]]
    final_norm = kinds[False].submodules.input_layernorm
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=final_norm)


# Ready object for Megatron-LM's `pretrain_gpt.py --spec megatron_dmoe.model.spec dmoe_layer_spec`.
dmoe_layer_spec = layer_spec(moe=True, use_transformer_engine=transformer_engine_available())
# ...whose block megatron-core builds with its own final norm: ours where it would be torch's, which
# refuses sequence parallelism (compat/block_final_norm.py)
use_for_block_final_norm(FusedNorm)
