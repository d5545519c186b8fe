"""Build a megatron-core GPTModel whose MLPs are our MoE layer, from a resolved run configuration."""
from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_dmoe.config import RunConfig
from megatron_dmoe.config.moe_settings import LAYER_PARAMS, value_of
from megatron_dmoe.model.spec import block_spec, transformer_engine_available
from megatron_dmoe.model.transformer_config import to_transformer_config
from megatron_dmoe.moe.run_state import MoERunState


def padded_vocab_size(vocab_size: int, cfg: RunConfig) -> int:
    """Megatron-LM's rule: round up so every tensor-parallel shard has a multiple of the divisor."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def moe_layer_params(cfg: RunConfig) -> dict:
    """Settings of our MoE layer that megatron's TransformerConfig has no field for (config/moe_settings.py)."""
    return {s.option: value_of(cfg, s.key) for s in LAYER_PARAMS}


def use_triton_cross_entropy(cfg: RunConfig, on_cuda: bool) -> bool:
    """Our fused cross-entropy: asked for (fusion on, impl auto or triton), on CUDA, whole vocabulary
    rows (tensor-parallel size 1; validation rejects triton otherwise)."""
    m = cfg.model
    return (on_cuda and m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl in ("auto", "triton")
            and cfg.parallel.tensor_model_parallel_size == 1)


class GPTModelWithFusedLoss(GPTModel):
    """megatron-core's GPTModel whose language-model loss runs on the fused cross-entropy Triton
    kernels of `dmoe_kernels.loss` when triton_cross_entropy is set (else megatron's own loss, as
    configured)."""

    def __init__(self, *args, triton_cross_entropy: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.triton_cross_entropy = triton_cross_entropy

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """labels [b, s], logits [s, b, V] -> loss [b, s] (fp32)."""
        if not self.triton_cross_entropy:
            return super().compute_language_model_loss(labels, logits)
        from dmoe_kernels.loss.functional import fused_cross_entropy  # triton: Linux only

        # the logits feed nothing but this loss: their storage takes the gradient
        loss = fused_cross_entropy(logits, labels.transpose(0, 1), inplace_backward=True)
        return loss.transpose(0, 1).contiguous()


def use_transformer_engine(cfg: RunConfig, on_cuda: bool) -> bool:
    impl = cfg.model.transformer_impl
    if impl == "auto":  # multi-latent attention and fp8: megatron-core's local modules (validation refuses TE)
        return (on_cuda and transformer_engine_available() and not cfg.model.multi_latent_attention
                and cfg.training.fp8 is None)
    return impl == "transformer_engine"


def sdpa_recomputes(config: TransformerConfig, core_attention: str, te: bool) -> bool:
    """Whether selective recompute is our SDPA core attention's own non-reentrant checkpoint rather
    than megatron's reentrant one: the only form per-layer CUDA graphs capture. Megatron's stays
    with dropout (whose RNG state its checkpoint replays) and with other core attentions."""
    return (config.recompute_granularity == "selective" and core_attention == "sdpa" and not te
            and config.attention_dropout == 0)


def build_gpt_model(
    cfg: RunConfig,
    vocab_size: int,
    on_cuda: bool,
    core_attention: str = "sdpa",
    run_state: Optional[MoERunState] = None,
    vp_stage: Optional[int] = None,
) -> GPTModel:
    """One model chunk for this pipeline stage (process groups must be initialised); `vp_stage`
    picks the chunk of this rank under the interleaved schedule (None without it).

    `vocab_size` is the tokenizer's; the embedding is padded as Megatron-LM pads it. The MoE layers
    share `run_state` (the training loop's), or one new state.
    """
    config = to_transformer_config(cfg, on_cuda=on_cuda)
    moe_params = moe_layer_params(cfg)
    if run_state is not None:
        moe_params["run_state"] = run_state
    te = use_transformer_engine(cfg, on_cuda)
    attention_recompute = sdpa_recomputes(config, core_attention, te)
    if attention_recompute:
        config.recompute_granularity = None  # SDPAttention checkpoints itself instead
    spec = block_spec(
        config,
        normalization=cfg.model.normalization,
        use_transformer_engine=te,
        core_attention=core_attention,
        moe_params=moe_params,
        vp_stage=vp_stage,
        attention_recompute=attention_recompute,
        qk_layernorm=cfg.model.qk_layernorm_scope if cfg.model.qk_layernorm else None,
        multi_latent_attention=cfg.model.multi_latent_attention,
        fp8=cfg.training.fp8,
    )
    model = GPTModelWithFusedLoss(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, cfg),
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
        rotary_percent=cfg.model.rotary_percent,
        triton_cross_entropy=use_triton_cross_entropy(cfg, on_cuda),
        vp_stage=vp_stage,
    )
    if on_cuda:
        model.cuda(torch.cuda.current_device())
        if cfg.training.fp8:  # its one host read-back, before any CUDA graph capture
            from dmoe_kernels.fp8 import cublas

            cublas.probe(torch.cuda.current_device())
    return model


def build_model_chunks(cfg: RunConfig, vocab_size: int, on_cuda: bool,
                       run_state: Optional[MoERunState] = None) -> List[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without the interleaved
    schedule), as Megatron-LM's get_model builds them."""
    virtual = cfg.parallel.virtual_pipeline_model_parallel_size
    stages = [None] if virtual is None else range(virtual)
    return [build_gpt_model(cfg, vocab_size, on_cuda, run_state=run_state, vp_stage=stage) for stage in stages]
