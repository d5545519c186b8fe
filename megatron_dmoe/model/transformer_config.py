"""Translate our run configuration into megatron-core's TransformerConfig.

MoE settings go into megatron's own `moe_*` fields, so the same layer reads the same values whether
it is built by our GPT builder or by Megatron-LM's `pretrain_gpt.py` from its command-line flags.
Settings megatron has no field for (expert backend, block size, memory-optimised experts, weight
renormalisation) travel as the MoE layer spec's params: see `gpt.moe_layer_params`.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron_dmoe.config import RunConfig
from megatron_dmoe.config.moe_layers import megatron_moe_layer_freq
from megatron_dmoe.config.moe_settings import AUX_LOSS_TYPES_MEGATRON, MOE_SETTINGS, value_of

MEGATRON_LOAD_BALANCING = {ours: theirs for theirs, ours in AUX_LOSS_TYPES_MEGATRON.items()}


def params_dtype(cfg: RunConfig) -> torch.dtype:
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def to_transformer_config(cfg: RunConfig, on_cuda: bool) -> TransformerConfig:
    """`cfg` must be resolved (see megatron_dmoe.config.resolve) and validated."""
    m, moe, par, tr = cfg.model, cfg.moe, cfg.parallel, cfg.training
    swiglu = m.activation == "swiglu"
    dtype = params_dtype(cfg)
    interleaved = par.virtual_pipeline_model_parallel_size is not None
    moe_kwargs = {}
    if moe.num_experts > 0:
        # each moe.* key into its TransformerConfig field (config/moe_settings.py), converted where
        # megatron-core says it otherwise: None for "none", the layer pattern, its balancing names
        moe_kwargs = {s.megatron: value_of(cfg, s.key) for s in MOE_SETTINGS
                      if s.megatron and s.key.startswith("moe.")}
        moe_kwargs.update(
            moe_layer_freq=megatron_moe_layer_freq(m.num_layers, moe.layer_freq, moe.first_dense_layers),
            moe_z_loss_coeff=moe.z_loss_coeff or None,
            moe_router_load_balancing_type=(
                MEGATRON_LOAD_BALANCING[moe.aux_loss_type] if moe.aux_loss_coeff > 0 else "none"),
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        )
    recompute = {}
    if tr.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif tr.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        layernorm_epsilon=m.norm_epsilon,
        # megatron's per-head query/key norm; the projection-wide one (model/attention.py) has its
        # weight split over the tensor-parallel ranks, whose gradients megatron-core would sum
        # across them for every q_layernorm / k_layernorm with this flag on
        qk_layernorm=m.qk_layernorm and m.qk_layernorm_scope == "head",
        ffn_hidden_size=m.ffn_hidden_size,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        # The fused kernels these flags select exist only on CUDA builds with apex / TE.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion and on_cuda,
        cross_entropy_fusion_impl="native",
        bf16=tr.bf16,
        fp16=tr.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        # NCCL and gloo match a batch's messages between two ranks in posting order, which swaps
        # the interleaved schedule's activations and gradients when both neighbours are one rank
        # (two stages); the interleaved schedule takes megatron's unbatched, overlapped exchange
        # (ordered by rank parity), as Megatron-LM does by default
        batch_p2p_comm=on_cuda and not interleaved,
        overlap_p2p_comm=interleaved,
        expert_model_parallel_size=par.expert_model_parallel_size,
        # set below: megatron-core refuses linear biases with ETP > 1 for its own experts' biases,
        # which ours do not have
        expert_tensor_parallel_size=1,
        sequence_parallel=par.sequence_parallel,
        use_cpu_initialization=not on_cuda or m.use_cpu_initialization,
        # whole layers (an empty scope), forward and backward; validation limits where this applies
        # `is True`: an unresolved `auto` (a model built outside dmoe-train) runs eagerly
        cuda_graph_impl="local" if tr.cuda_graphs is True and on_cuda else "none",
        cuda_graph_scope=[],
        **recompute,
        **moe_kwargs,
    )
    config_class = TransformerConfig
    if m.multi_latent_attention:
        config_class = MLATransformerConfig
        kwargs.update(latent_attention_kwargs(cfg))
    with warnings.catch_warnings():
        # megatron-core's own default cuda_graph_scope trips its own deprecation notice
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        config = config_class(**kwargs)
    config.expert_tensor_parallel_size = par.expert_tensor_parallel_size
    return config


def latent_attention_kwargs(cfg: RunConfig) -> dict:
    """MLATransformerConfig's fields of multi-latent attention, from the model.* keys of the same names."""
    m = cfg.model
    return dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type=m.rope_type,
        rotary_base=m.rotary_base,
        rotary_scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.original_max_position_embeddings,
        beta_fast=m.beta_fast,
        beta_slow=m.beta_slow,
        mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim,
        # every head has its own key and value; megatron-core sizes the key-value cache by groups
        num_query_groups=m.num_attention_heads,
        kv_channels=None,
        qk_layernorm=m.qk_layernorm,
        # the local modules (0.19 resolves the latents' norms with this backend's)
        transformer_impl="local",
    )
