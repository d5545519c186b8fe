"""model.multi_latent_attention (megatron-core's MLA) with the keys it reads, and the settings of
the usual attention that it has no use for."""
from __future__ import annotations

from .state import CheckState

# the MLA keys that only describe multi-latent attention (a value set without it is a mistake)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def check(state: CheckState) -> None:
    v, raw = state.v, state.raw
    if not state.ok("model.multi_latent_attention"):
        return
    if not v("model.multi_latent_attention"):
        if state.ok("model.rope_type") and v("model.rope_type") == "yarn":
            state.problem("model.rope_type", "yarn is built for multi-latent attention only (megatron-core's "
                          "attention rotates with rope); set model.multi_latent_attention=true or use rope")
        return
    if state.ok("model.position_embedding_type") and v("model.position_embedding_type") != "rope":
        state.problem("model.position_embedding_type", f"{v('model.position_embedding_type')}: multi-latent "
                      "attention rotates its position part itself; use rope")
    if raw("model.num_query_groups") is not None and state.ok("model.num_query_groups", "model.num_attention_heads") \
            and v("model.num_query_groups") != v("model.num_attention_heads"):
        state.problem("model.num_query_groups", f"{v('model.num_query_groups')}: multi-latent attention gives every "
                      "head its own key and value (no grouped-query attention); leave it unset")
    if raw("model.kv_channels") is not None:
        state.problem("model.kv_channels", "is not used by multi-latent attention, whose heads' widths are "
                      "model.qk_head_dim, model.qk_pos_emb_head_dim and model.v_head_dim; leave it unset")
    if state.ok("model.add_qkv_bias") and v("model.add_qkv_bias"):
        state.problem("model.add_qkv_bias", "true: megatron-core's multi-latent attention builds its projections "
                      "without biases; leave it false")
    if state.ok("model.qk_pos_emb_head_dim") and v("model.qk_pos_emb_head_dim") % 2:
        state.problem("model.qk_pos_emb_head_dim", f"{v('model.qk_pos_emb_head_dim')}: RoPE rotates pairs of "
                      "dimensions; use an even width")
    if state.ok("model.qk_layernorm", "model.qk_layernorm_scope") and v("model.qk_layernorm") \
            and v("model.qk_layernorm_scope") != "head":
        state.problem("model.qk_layernorm_scope", f"{v('model.qk_layernorm_scope')}: with multi-latent attention "
                      "model.qk_layernorm normalises the latents; leave the scope at head")
    if state.ok("model.transformer_impl") and v("model.transformer_impl") == "transformer_engine":
        state.problem("model.transformer_impl", "transformer_engine: multi-latent attention is built from "
                      "megatron-core's local modules here; use auto or local")
