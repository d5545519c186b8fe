"""model.*: heads, query groups and positions, and what the machine and megatron-core build of them."""
from __future__ import annotations

from megatron_dmoe.parallel.layout_rules import TP_KEY, divisors

from .state import CheckState


def _check_rotary_percent(state: CheckState) -> None:
    """RoPE over a share of each head: only with RoPE, and on an even number of dimensions (pairs)."""
    v, ok, key = state.v, state.ok, "model.rotary_percent"
    if not ok(key, "model.position_embedding_type") or v(key) == 1.0:
        return
    if v("model.position_embedding_type") != "rope":
        state.problem(key, f"{v(key)} applies to RoPE only, but model.position_embedding_type is "
                      f"{v('model.position_embedding_type')}; set it to rope, or {key}: 1.0")
    elif ok("model.kv_channels", "model.hidden_size", "model.num_attention_heads"):
        head = v("model.kv_channels") or v("model.hidden_size") // v("model.num_attention_heads")
        rotated = head * v(key)
        if rotated != int(rotated) or int(rotated) % 2:
            example = 2 * max(1, int(rotated) // 2) / head
            state.problem(key, f"{v(key)} of the heads' {head} dimensions is {rotated:g}: RoPE rotates pairs, so "
                          f"use a share that gives an even whole number (e.g. {example:g})")


def check(state: CheckState) -> None:
    v = state.v
    if state.ok("model.hidden_size", "model.num_attention_heads"):
        hidden, heads = v("model.hidden_size"), v("model.num_attention_heads")
        if hidden % heads:
            state.problem("model.hidden_size", f"{hidden} is not divisible by "
                          f"model.num_attention_heads ({heads}); use a multiple of {heads}")
    if state.raw("model.num_query_groups") is not None and state.ok(
            "model.num_query_groups", "model.num_attention_heads"):
        groups, heads = v("model.num_query_groups"), v("model.num_attention_heads")
        if heads % groups:
            state.problem("model.num_query_groups", f"{groups} does not divide "
                          f"model.num_attention_heads ({heads}); use one of: {divisors(heads)}")
    if state.raw("model.max_position_embeddings") is not None and state.ok(
            "model.seq_length", "model.max_position_embeddings"):
        seq, max_pos = v("model.seq_length"), v("model.max_position_embeddings")
        if seq > max_pos:
            state.problem("model.seq_length", f"{seq} is larger than "
                          f"model.max_position_embeddings ({max_pos}); use a sequence length "
                          f"up to {max_pos} or raise max_position_embeddings")
    _check_rotary_percent(state)
    release = state.env.megatron_core
    if state.ok("model.qk_layernorm", "model.qk_layernorm_scope") and v("model.qk_layernorm") \
            and v("model.qk_layernorm_scope") == "projection" and release is not None and release >= (0, 19):
        state.problem("model.qk_layernorm_scope", "projection (a query/key norm over all heads, OLMoE's) is not "
                      f"built with megatron-core {release[0]}.{release[1]}, whose attention takes per-head "
                      "query/key norms only; use megatron-core 0.16 for this model")
    if state.ok("model.transformer_impl") and not state.env.transformer_engine \
            and v("model.transformer_impl") == "transformer_engine":
        state.problem("model.transformer_impl", "'transformer_engine' needs Transformer Engine, "
                      "which cannot be imported here; use auto or local")
    if state.ok("model.cross_entropy_fusion_impl", TP_KEY) and v("model.cross_entropy_fusion_impl") == "triton" \
            and v(TP_KEY) > 1:
        state.problem("model.cross_entropy_fusion_impl", f"triton needs whole vocabulary rows, but {TP_KEY} "
                      f"is {v(TP_KEY)} (the logits are split over the vocabulary); use auto or native")
