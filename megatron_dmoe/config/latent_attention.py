"""Multi-latent attention's sizes (model.multi_latent_attention), for counting its FLOPs and memory
without building it: its projections' [in, out] shapes and the widths its core attention sees."""
from __future__ import annotations

from typing import List, Tuple


def projection_shapes(m) -> List[Tuple[int, int]]:
    """[in, out] of each weight matrix of one layer's attention (m: the resolved model section):
    megatron-core's MLASelfAttention's query (one, or down and up through the latent), key/value
    down (latent and rotated key part) and up, and output projections."""
    h, heads = m.hidden_size, m.num_attention_heads
    query = heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    shapes = [(h, query)] if m.q_lora_rank is None else [(h, m.q_lora_rank), (m.q_lora_rank, query)]
    return shapes + [(h, m.kv_lora_rank + m.qk_pos_emb_head_dim),
                     (m.kv_lora_rank, heads * (m.qk_head_dim + m.v_head_dim)),
                     (heads * m.v_head_dim, h)]


def latent_norm_widths(m) -> int:
    """The elements of the latents' norm weights (model.qk_layernorm)."""
    if not m.qk_layernorm:
        return 0
    return m.kv_lora_rank + (m.q_lora_rank or 0)


def core_widths(m) -> Tuple[int, int]:
    """(query/key width, value width) of all heads together, as core attention gets them."""
    heads = m.num_attention_heads
    return heads * (m.qk_head_dim + m.qk_pos_emb_head_dim), heads * m.v_head_dim
