"""Our multi-latent-attention dMoE's weights by the names of transformers' DeepSeek-V2/V3, both ways.

Multi-latent attention's tensors are the same in both, named differently: megatron-core's down
projections (q_a_proj, kv_a_proj_with_mqa: the latent, then the shared rotated key part), latent
norms and up projections (q_b_proj, kv_b_proj: per head its unrotated query/key part, then its
rotated query part or its value) are DeepSeek's, row for row. DeepSeek's RoPE rotates interleaved
pairs of the rotated part; megatron-core's MLA takes those pairs apart before rotating halves, so
no permutation is needed either. The other changes of shape:
- the first dense layers' gate and up projections are megatron's one linear_fc1 (gate rows first);
- the routed experts are stacked as for the other families (hf_weights.py);
- the shared experts are one SwiGLU MLP (w1, v1, w2 [ffn, hidden]), its down projection transposed;
- DeepSeek-V3's selection bias (e_score_correction_bias) is the router's expert_bias.
Neither has DeepSeek-V3's multi-token-prediction layers: an import leaves them out, an export has none.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_dmoe.export.hf_families import MLP_NAMES
from megatron_dmoe.export.hf_weights import DENSE_MLP, EXPERTS, OUTPUT, SHARED, TOP_LEVEL


def _attention_names(m) -> List[Tuple[str, str]]:
    """(ours, theirs) of one layer's attention, without the layer prefix."""
    names = [("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
             ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight")]
    if m.q_lora_rank is None:
        return [("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight")] + names
    return [("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
            ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
            ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight")] + names


def _layer_names(m, moe, dense: bool) -> List[Tuple[str, str]]:
    """(ours, theirs) of the tensors of one layer that are the same in both."""
    names = [("input_layernorm.weight", "input_layernorm.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")] + _attention_names(m)
    if dense:
        return names + [(DENSE_MLP[1], "mlp.down_proj.weight")]
    names.append(("mlp.router.weight", "mlp.gate.weight"))
    if moe.router_enable_expert_bias:
        names.append(("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
    return names


def _prefixes(i: int) -> Tuple[str, str]:
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def _is_dense(moe, i: int) -> bool:
    return i < moe.first_dense_layers


def hf_names(m, moe, untied: bool) -> List[str]:
    """Every tensor name a DeepSeek-V2/V3 checkpoint of this shape holds (m, moe: the run's model and
    moe sections)."""
    names = [theirs for _, theirs in TOP_LEVEL] + ([OUTPUT[1]] if untied else [])
    for i in range(m.num_layers):
        dst = _prefixes(i)[1]
        dense = _is_dense(moe, i)
        names += [dst + theirs for _, theirs in _layer_names(m, moe, dense)]
        if dense:
            names += [dst + "mlp.gate_proj.weight", dst + "mlp.up_proj.weight"]
            continue
        names += [dst + f"mlp.experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in MLP_NAMES]
        names += [dst + f"mlp.shared_experts.{p}.weight" for p in MLP_NAMES]
    return names


def to_hf(state: Dict[str, torch.Tensor], m, moe) -> Dict[str, torch.Tensor]:
    """Our model's state (weights.model_state) -> DeepSeek's tensors."""
    out = {theirs: state[ours] for ours, theirs in TOP_LEVEL}
    if m.untie_embeddings_and_output_weights:
        out[OUTPUT[1]] = state[OUTPUT[0]]
    for i in range(m.num_layers):
        src, dst = _prefixes(i)
        dense = _is_dense(moe, i)
        out.update({dst + theirs: state[src + ours] for ours, theirs in _layer_names(m, moe, dense)})
        if dense:
            gate, up = state[src + DENSE_MLP[0]].chunk(2, dim=0)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
            continue
        w1, v1, w2 = (state[src + name] for name in EXPERTS)
        for e in range(w1.shape[0]):
            expert = dst + f"mlp.experts.{e}."
            out.update({expert + "gate_proj.weight": w1[e], expert + "up_proj.weight": v1[e],
                        expert + "down_proj.weight": w2[e].t()})
        s1, s3, s2 = (state[src + name] for name in SHARED)
        out.update({dst + "mlp.shared_experts.gate_proj.weight": s1, dst + "mlp.shared_experts.up_proj.weight": s3,
                    dst + "mlp.shared_experts.down_proj.weight": s2.t()})
    return out


def from_hf(read: Callable[[str], torch.Tensor], m, moe) -> Dict[str, torch.Tensor]:
    """DeepSeek's tensors (`read(name)`) -> our model's state by name: the inverse of to_hf."""
    out = {ours: read(theirs) for ours, theirs in TOP_LEVEL}
    if m.untie_embeddings_and_output_weights:
        out[OUTPUT[0]] = read(OUTPUT[1])
    for i in range(m.num_layers):
        src, dst = _prefixes(i)
        dense = _is_dense(moe, i)
        out.update({src + ours: read(dst + theirs) for ours, theirs in _layer_names(m, moe, dense)})
        if dense:
            out[src + DENSE_MLP[0]] = torch.cat([read(dst + "mlp.gate_proj.weight"), read(dst + "mlp.up_proj.weight")])
            continue
        expert = dst + "mlp.experts.{}.{}.weight"
        gate, up, down = ([read(expert.format(e, p)) for e in range(moe.num_experts)] for p in MLP_NAMES)
        out[src + EXPERTS[0]] = torch.stack(gate)
        out[src + EXPERTS[1]] = torch.stack(up)
        out[src + EXPERTS[2]] = torch.stack([w.t() for w in down])
        shared = dst + "mlp.shared_experts.{}.weight"
        out[src + SHARED[0]] = read(shared.format("gate_proj"))
        out[src + SHARED[1]] = read(shared.format("up_proj"))
        out[src + SHARED[2]] = read(shared.format("down_proj")).t()
    return out


def prediction_layer_names(names, num_layers: int, count: int) -> List[str]:
    """The tensors among `names` of DeepSeek-V3's `count` multi-token-prediction layers (numbered
    after the model's layers), which transformers leaves out of its model too."""
    prefixes = tuple(f"model.layers.{num_layers + i}." for i in range(count))
    return [n for n in names if n.startswith(prefixes)]
