"""Our models' weights by the names of a transformers family (hf_families.py), both ways.

One table (`_layer_names`) pairs our names with theirs; `to_hf` (export) and `from_hf` (dmoe-import)
read it, and only these kinds of tensor change shape on the way:
- megatron-core's fused linear_qkv (rows per query group: its queries, its key, its value) and its
  bias are split into q_proj, k_proj and v_proj, and put back together (weights.split_qkv, fuse_qkv);
- a dense SwiGLU MLP's linear_fc1 holds the gate's rows, then the up projection's (megatron's
  chunks of the GLU); theirs are gate_proj and up_proj;
- our experts are stacked: expert e computes silu(x w1[e]^T) * (x v1[e]^T) @ w2[e], all three
  [experts, ffn, hidden]; theirs are one module per expert: the gate (w1), the up projection (v1)
  and the down projection ([hidden, ffn]: w2[e] transposed); a shared expert is laid out like one
  expert (w1, v1, w2 [ffn, hidden]) with its gate's weight [1, hidden];
- the output layer exists only with untied embeddings.
megatron's RoPE rotates halves (not interleaved pairs), as transformers' does, so queries and keys
need no permutation; the query/key norms' weights are per head ([head_dim], Qwen3-MoE, Qwen3) or
over the projection ([heads * head_dim], OLMoE) in both.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_dmoe.export.hf_families import Family
from megatron_dmoe.export.weights import fuse_qkv, split_qkv

TOP_LEVEL = (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             ("decoder.final_layernorm.weight", "model.norm.weight"))
OUTPUT = ("output_layer.weight", "lm_head.weight")
QKV = "self_attention.linear_qkv."
EXPERTS = ("mlp.experts.w1", "mlp.experts.v1", "mlp.experts.w2")
SHARED = ("mlp.shared_experts.w1", "mlp.shared_experts.v1", "mlp.shared_experts.w2")
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def _layer_names(family: Family) -> List[Tuple[str, str]]:
    """(ours, theirs) of the tensors of one layer that are the same in both, without the layer prefix."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if family.moe:
        names.append(("mlp.router.weight", f"{family.moe}.gate.weight"))
    if family.shared_expert:
        names.append(("mlp.shared_experts.gate_weight", f"{family.moe}.shared_expert_gate.weight"))
    if family.qk_norm:
        names += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                  ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    return names


def _prefixes(i: int) -> Tuple[str, str]:
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def _qkv_kinds(qkv_bias: bool) -> Tuple[str, ...]:
    return ("weight", "bias") if qkv_bias else ("weight",)


def hf_names(family: Family, num_layers: int, num_experts: int, untied: bool, qkv_bias: bool = False) -> List[str]:
    """Every tensor name a checkpoint of this family and shape holds."""
    names = [theirs for _, theirs in TOP_LEVEL] + ([OUTPUT[1]] if untied else [])
    for i in range(num_layers):
        dst = _prefixes(i)[1]
        names += [dst + theirs for _, theirs in _layer_names(family)]
        names += [dst + f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in _qkv_kinds(qkv_bias)]
        if family.moe is None:
            names += [dst + f"mlp.{n}.weight" for n in family.experts]
            continue
        names += [dst + f"{family.moe}.experts.{e}.{n}.weight" for e in range(num_experts) for n in family.experts]
        if family.shared_expert:
            names += [dst + f"{family.moe}.shared_expert.{n}.weight" for n in family.experts]
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
        for kind in _qkv_kinds(m.add_qkv_bias):
            q, k, v = split_qkv(state[src + QKV + kind], m.num_attention_heads, m.num_query_groups, head_dim)
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v})
        if family.moe is None:
            fc1_gate, fc1_up = state[src + DENSE_MLP[0]].chunk(2)
            out.update({dst + f"mlp.{gate}.weight": fc1_gate, dst + f"mlp.{up}.weight": fc1_up,
                        dst + f"mlp.{down}.weight": state[src + DENSE_MLP[1]]})
            continue
        w1, v1, w2 = (state[src + name] for name in EXPERTS)
        for e in range(w1.shape[0]):
            expert = dst + f"{family.moe}.experts.{e}."
            out[expert + f"{gate}.weight"] = w1[e]
            out[expert + f"{up}.weight"] = v1[e]
            out[expert + f"{down}.weight"] = w2[e].t()
        if family.shared_expert:
            w1, v1, w2 = (state[src + name] for name in SHARED)
            shared = dst + f"{family.moe}.shared_expert."
            out.update({shared + f"{gate}.weight": w1, shared + f"{up}.weight": v1, shared + f"{down}.weight": w2.t()})
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
        for kind in _qkv_kinds(m.add_qkv_bias):
            out[src + QKV + kind] = fuse_qkv(*(read(dst + f"self_attn.{p}_proj.{kind}") for p in "qkv"),
                                             m.num_attention_heads, m.num_query_groups, head_dim)
        if family.moe is None:
            out[src + DENSE_MLP[0]] = torch.cat([read(dst + f"mlp.{gate}.weight"), read(dst + f"mlp.{up}.weight")])
            out[src + DENSE_MLP[1]] = read(dst + f"mlp.{down}.weight")
            continue
        expert = dst + f"{family.moe}.experts.{{}}.{{}}.weight"
        out[src + EXPERTS[0]] = torch.stack([read(expert.format(e, gate)) for e in range(num_experts)])
        out[src + EXPERTS[1]] = torch.stack([read(expert.format(e, up)) for e in range(num_experts)])
        out[src + EXPERTS[2]] = torch.stack([read(expert.format(e, down)).t() for e in range(num_experts)])
        if family.shared_expert:
            shared = dst + f"{family.moe}.shared_expert.{{}}.weight"
            out[src + SHARED[0]] = read(shared.format(gate))
            out[src + SHARED[1]] = read(shared.format(up))
            out[src + SHARED[2]] = read(shared.format(down)).t()
    return out
