"""Model FLOPs per token and model FLOPs utilisation (MFU).

Counts what the model must compute, not what the hardware ends up doing: padding rows of the
block-sparse experts, activation recompute and element-wise ops are left out, as in Megatron-LM's
own throughput report, so numbers stay comparable across backends and with published runs.
"""
from __future__ import annotations

from typing import Optional

from megatron_dmoe.config import latent_attention
from megatron_dmoe.config.moe_layers import moe_layer_pattern
from megatron_dmoe.config.resolve import resolve
from megatron_dmoe.config.schema import RunConfig

# Backward computes two matmuls per forward matmul (gradient of the input and of the weight).
TRAINING_FLOPS_PER_FORWARD_FLOP = 3


def model_flops_per_token(cfg: RunConfig, vocab_size: Optional[int] = None) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token, counting active parameters only.

    With h = hidden_size, s = seq_length, d = h / num_attention_heads, g = num_query_groups
    (None = num_attention_heads), V = vocab_size, a matmul with an [in x out] weight costs
    2 * in * out FLOPs per token forward. Per layer, forward:

        attention projections   2 * (h*h  [q]  +  2*h*g*d  [k, v]  +  h*h  [output])
        scores and values       2 * 2 * s * h   (Q.K^T and P.V; causal masking NOT halved,
                                                 as Megatron-LM counts)
        (multi-latent attention: 2 * in * out of each projection, config/latent_attention.py,
        and 2 * s * (q_k + v), q_k and v its heads' query/key and value widths together)
        dense MLP               2 * m * h * f,  f = model.ffn_hidden_size (None = 4*h)
        MoE MLP                 2 * top_k * m * h * f_e  +  2 * h * E  [router]
                                f_e = moe.ffn_hidden_size (None = f), E = moe.num_experts
                                + 2 * m * h * f_s  +  2 * h [gate]  (shared expert of width f_s)

    where m = 3 matrices for SwiGLU (gate, up, down) and 2 for GELU. Layers 0, layer_freq,
    2*layer_freq, ... from moe.first_dense_layers on are MoE layers when num_experts > 0; the others
    are dense. Once per token the output logits add 2 * h * V. Embedding lookups, norms, softmax and
    activations are not counted.
    A capacity-factor MoE is counted as if no token were dropped (an upper bound).

    ``vocab_size`` is the output layer's width: pass the padded size the model was built with to
    match Megatron-LM's report. None falls back to ``cfg.model.vocab_size``.
    """
    cfg = resolve(cfg)
    model, moe = cfg.model, cfg.moe
    vocab = _vocab_size(cfg, vocab_size)
    h, s = model.hidden_size, model.seq_length
    heads, groups = model.num_attention_heads, model.num_query_groups
    if heads <= 0 or h % heads != 0:
        raise ValueError(
            f"model.num_attention_heads={heads} must be positive and divide model.hidden_size={h} "
            "to count attention FLOPs")
    head_dim = h // heads
    matrices = _mlp_matrices(model.activation)

    attention = 2 * (2 * h * h + 2 * h * groups * head_dim) + 2 * 2 * s * h
    if model.multi_latent_attention:  # its projections, and scores and values at its heads' widths
        qk, v = latent_attention.core_widths(model)
        attention = 2 * sum(i * o for i, o in latent_attention.projection_shapes(model)) + 2 * s * (qk + v)
    dense_mlp = 2 * matrices * h * model.ffn_hidden_size
    num_moe = _num_moe_layers(cfg)
    moe_mlp = 2 * moe.top_k * matrices * h * moe.ffn_hidden_size + 2 * h * moe.num_experts
    moe_mlp += 2 * matrices * h * moe.shared_expert_ffn_hidden_size + (2 * h if moe.shared_expert_gate else 0)
    forward = (model.num_layers * attention + (model.num_layers - num_moe) * dense_mlp
               + num_moe * moe_mlp + 2 * h * vocab)
    return float(TRAINING_FLOPS_PER_FORWARD_FLOP * forward)


def expert_flops_per_token(cfg: RunConfig) -> float:
    """Forward FLOPs of the routed experts' products per token (every MoE layer, top_k copies, no
    router or shared expert): also what their weight gradients cost in backward."""
    cfg = resolve(cfg)
    per_copy = 2 * _mlp_matrices(cfg.model.activation) * cfg.model.hidden_size * cfg.moe.ffn_hidden_size
    return float(_num_moe_layers(cfg) * cfg.moe.top_k * per_copy)


def mfu(tflops_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation as a fraction (0.42 = 42 %) of the device's peak TFLOP/s."""
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be a positive number, got {peak_tflops!r}")
    return tflops_per_gpu / peak_tflops


def _vocab_size(cfg: RunConfig, vocab_size: Optional[int]) -> int:
    vocab = vocab_size if vocab_size is not None else cfg.model.vocab_size
    if vocab is None:
        raise ValueError(
            "model_flops_per_token needs the vocabulary size: pass vocab_size= (the tokenizer's, "
            "padded as the model pads it) or set model.vocab_size")
    if vocab <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab}")
    return int(vocab)


def _mlp_matrices(activation: str) -> int:
    if activation == "swiglu":
        return 3
    if activation == "gelu":
        return 2
    raise ValueError(f"model.activation={activation!r} is not counted: use 'gelu' or 'swiglu'")


def _num_moe_layers(cfg: RunConfig) -> int:
    moe = cfg.moe
    if moe.num_experts <= 0:
        return 0
    if moe.layer_freq <= 0:
        raise ValueError(f"moe.layer_freq={moe.layer_freq} must be a positive integer")
    return sum(moe_layer_pattern(cfg.model.num_layers, moe.layer_freq, moe.first_dense_layers))
