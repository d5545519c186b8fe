"""Our dMoE's weights by the names of a transformers MoE family (moe_families.py), both ways.

One table (`_layer_names`) pairs our names with theirs; `to_hf` (export) and `from_hf` (dmoe-import)
read it, and only three kinds of tensor change shape on the way:
- megatron-core's fused linear_qkv (rows per query group: its queries, its key, its value) is
  split into q_proj, k_proj and v_proj, and put back together (weights.split_qkv, fuse_qkv);
- our experts are stacked: expert e computes silu(x w1[e]^T) * (x v1[e]^T) @ w2[e], all three
  [experts, ffn, hidden]; theirs are one module per expert: the gate (w1), the up projection (v1)
  and the down projection ([hidden, ffn]: w2[e] transposed);
- the output layer exists only with untied embeddings.
megatron's RoPE rotates halves (not interleaved pairs), as transformers' does, so queries and keys
need no permutation; the query/key norms' weights are per head ([head_dim], Qwen3-MoE) or over
the projection ([heads * head_dim], OLMoE) in both.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_dmoe.export.moe_families import Family
from megatron_dmoe.export.weights import fuse_qkv, split_qkv

TOP_LEVEL = (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             ("decoder.final_layernorm.weight", "model.norm.weight"))
OUTPUT = ("output_layer.weight", "lm_head.weight")
QKV = "self_attention.linear_qkv.weight"
EXPERTS = ("mlp.experts.w1", "mlp.experts.v1", "mlp.experts.w2")


def _layer_names(family: Family) -> List[Tuple[str, str]]:
    """(ours, theirs) of the tensors of one layer that are the same in both, without the layer prefix."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
             ("mlp.router.weight", f"{family.moe}.gate.weight")]
    if family.qk_norm:
        names += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                  ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    return names


def _prefixes(i: int) -> Tuple[str, str]:
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def hf_names(family: Family, num_layers: int, num_experts: int, untied: bool) -> List[str]:
    """Every tensor name a checkpoint of this family and shape holds."""
    names = [theirs for _, theirs in TOP_LEVEL] + ([OUTPUT[1]] if untied else [])
    for i in range(num_layers):
        dst = _prefixes(i)[1]
        names += [dst + theirs for _, theirs in _layer_names(family)]
        names += [dst + f"self_attn.{p}_proj.weight" for p in "qkv"]
        names += [dst + f"{family.moe}.experts.{e}.{n}.weight" for e in range(num_experts) for n in family.experts]
    return names


def to_hf(state: Dict[str, torch.Tensor], family: Family, m, head_dim: int) -> Dict[str, torch.Tensor]:
    """Our model's state (weights.model_state) -> the family's tensors. m: the run's model config."""
    out = {theirs: state[ours] for ours, theirs in TOP_LEVEL}
    if m.untie_embeddings_and_output_weights:
        out[OUTPUT[1]] = state[OUTPUT[0]]
    gate, up, down = family.experts
    for i in range(m.num_layers):
        src, dst = _prefixes(i)
        out.update({dst + theirs: state[src + ours] for ours, theirs in _layer_names(family)})
        q, k, v = split_qkv(state[src + QKV], m.num_attention_heads, m.num_query_groups, head_dim)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        w1, v1, w2 = (state[src + name] for name in EXPERTS)
        for e in range(w1.shape[0]):
            expert = dst + f"{family.moe}.experts.{e}."
            out[expert + f"{gate}.weight"] = w1[e]
            out[expert + f"{up}.weight"] = v1[e]
            out[expert + f"{down}.weight"] = w2[e].t()
    return out


def from_hf(read: Callable[[str], torch.Tensor], family: Family, m, head_dim: int,
            num_experts: int) -> Dict[str, torch.Tensor]:
    """The family's tensors (`read(name)`) -> our model's state by name: the inverse of to_hf."""
    out = {ours: read(theirs) for ours, theirs in TOP_LEVEL}
    if m.untie_embeddings_and_output_weights:
        out[OUTPUT[0]] = read(OUTPUT[1])
    gate, up, down = family.experts
    for i in range(m.num_layers):
        src, dst = _prefixes(i)
        out.update({src + ours: read(dst + theirs) for ours, theirs in _layer_names(family)})
        out[src + QKV] = fuse_qkv(*(read(dst + f"self_attn.{p}_proj.weight") for p in "qkv"),
                                  m.num_attention_heads, m.num_query_groups, head_dim)
        expert = dst + f"{family.moe}.experts.{{}}.{{}}.weight"
        out[src + EXPERTS[0]] = torch.stack([read(expert.format(e, gate)) for e in range(num_experts)])
        out[src + EXPERTS[1]] = torch.stack([read(expert.format(e, up)) for e in range(num_experts)])
        out[src + EXPERTS[2]] = torch.stack([read(expert.format(e, down)).t() for e in range(num_experts)])
    return out
