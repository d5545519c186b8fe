"""DmoeGptForCausalLM: megatron_dmoe's GPT, dense or MoE, for transformers.

dmoe-export copies this file into a model directory whose model no stock transformers architecture
computes (a GPT MoE with LayerNorm, GELU experts, learned positions and biases, as the quick-start
and zoo models are); load it with

    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

It imports only torch and transformers (never megatron_dmoe), and its modules and parameters carry
megatron-core's names, so model.safetensors holds the training checkpoint's tensors as they are:

    embedding.word_embeddings, embedding.position_embeddings (learned positions only)
    decoder.layers.N.input_layernorm, .self_attention.linear_qkv / .linear_proj (/ .q_layernorm,
        .k_layernorm), .pre_mlp_layernorm, .mlp (dense: linear_fc1, linear_fc2; MoE: router,
        experts.w1 / v1 / w2, shared_experts)
    decoder.final_layernorm, output_layer (untied embeddings only)

What each computes (megatron-core's GPT and megatron_dmoe's MoE layer, in inference):
- pre-norm layers: x + attention(norm(x)), then x + mlp(norm(x)); LayerNorm (weight and bias) or
  RMSNorm (weight), statistics in fp32;
- linear_qkv's rows come per query group: that group's query heads, its key, its value; queries
  and keys are normalised per head or over the whole projection (qk_layernorm), then rotated
  (RoPE on rotated halves, every dimension) when positions are rotary; causal attention scaled by
  1 / sqrt(head_dim);
- activations: exact (erf) GELU, or SwiGLU (silu of the first half of linear_fc1's output times
  the second half; experts: silu(x w1^T) * (x v1^T));
- MoE layers: fp32 router logits x W^T; softmax over all experts then top-k (router_pre_softmax),
  or top-k of the logits then a softmax over those k; or sigmoid scores, top-k of scores plus the
  expert bias (which picks, never weighs); optionally within the best router_group_topk of
  router_num_groups expert groups; weights renormalised to sum 1 (router_renormalize) and scaled
  (router_topk_scaling_factor); expert e: act(x w1[e]^T) @ w2[e] (w1, w2 [experts, ffn, hidden]),
  no biases; every token routed (dropless); plus the shared MLP, times sigmoid(x g) with its gate.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers before its configs were renamed
    from transformers import PretrainedConfig as PreTrainedConfig

# where this transformers version returns the key-value cache (renamed from past_key_values)
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} \
    else "past_key_values"


class DmoeGptConfig(PreTrainedConfig):
    model_type = "dmoe_gpt"

    def __init__(self, vocab_size: int = 384, hidden_size: int = 128, num_hidden_layers: int = 2,
                 num_attention_heads: int = 4, num_key_value_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, intermediate_size: int = 512,
                 max_position_embeddings: int = 128, position_embedding_type: str = "learned_absolute",
                 rotary_base: float = 10000.0, normalization: str = "LayerNorm", norm_eps: float = 1e-5,
                 activation: str = "gelu", add_bias_linear: bool = True, add_qkv_bias: bool = False,
                 qk_layernorm: Optional[str] = None,
                 moe_layers: Optional[List[int]] = None, num_experts: int = 0, num_experts_per_tok: int = 1,
                 moe_intermediate_size: Optional[int] = None, router_score_function: str = "softmax",
                 router_pre_softmax: bool = True, router_renormalize: bool = False,
                 router_topk_scaling_factor: float = 1.0, router_expert_bias: bool = False,
                 router_num_groups: Optional[int] = None, router_group_topk: Optional[int] = None,
                 router_group_score: str = "sum", shared_expert_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, tie_word_embeddings: bool = True,
                 initializer_range: float = 0.02, use_cache: bool = True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type  # learned_absolute | rope
        self.rotary_base = rotary_base
        self.normalization = normalization  # LayerNorm | RMSNorm
        self.norm_eps = norm_eps
        self.activation = activation  # gelu | swiglu
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias  # biases on linear_qkv whatever add_bias_linear says
        self.qk_layernorm = qk_layernorm  # None | head | projection
        self.moe_layers = list(moe_layers or [])  # the layers (from 0) whose MLP is the MoE
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.router_score_function = router_score_function  # softmax | sigmoid
        self.router_pre_softmax = router_pre_softmax
        self.router_renormalize = router_renormalize
        self.router_topk_scaling_factor = router_topk_scaling_factor
        self.router_expert_bias = router_expert_bias
        self.router_num_groups = router_num_groups
        self.router_group_topk = router_group_topk
        self.router_group_score = router_group_score  # sum | max
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.shared_expert_gate = shared_expert_gate
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class Norm(nn.Module):
    def __init__(self, width: int, config: DmoeGptConfig):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            x32 = x.float()
            normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            return self.weight * normed
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def activate(activation: str, h1: torch.Tensor, h2: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.silu(h1) * h2 if activation == "swiglu" else F.gelu(h1)


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE on rotated halves; x [batch, heads, seq, head_dim], positions [batch, seq]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.float()[:, None, :, None] * inv_freq  # [batch, 1, seq, dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * emb.cos() + rotated * emb.sin()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DmoeGptConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        heads, groups, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, (heads + 2 * groups) * hd,
                                    bias=config.add_bias_linear or config.add_qkv_bias)
        self.linear_proj = nn.Linear(heads * hd, config.hidden_size, bias=config.add_bias_linear)
        if config.qk_layernorm == "head":
            self.q_layernorm, self.k_layernorm = Norm(hd, config), Norm(hd, config)
        elif config.qk_layernorm == "projection":
            self.q_layernorm, self.k_layernorm = Norm(heads * hd, config), Norm(groups * hd, config)

    def forward(self, x, positions, mask, cache):
        c = self.config
        batch, seq, _ = x.shape
        heads, groups, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        per_group = heads // groups
        qkv = self.linear_qkv(x).view(batch, seq, groups, per_group + 2, hd)
        q = qkv[:, :, :, :per_group].reshape(batch, seq, heads, hd)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if c.qk_layernorm == "head":
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        elif c.qk_layernorm == "projection":
            q = self.q_layernorm(q.reshape(batch, seq, -1)).view(batch, seq, heads, hd)
            k = self.k_layernorm(k.reshape(batch, seq, -1)).view(batch, seq, groups, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, hd]
        if c.position_embedding_type == "rope":
            q, k = rotate(q, positions, c.rotary_base), rotate(k, positions, c.rotary_base)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hd))
        return self.linear_proj(out.transpose(1, 2).reshape(batch, seq, heads * hd))


class MLP(nn.Module):
    """A dense layer's MLP: linear_fc1 (both SwiGLU halves, gate first), activation, linear_fc2."""

    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.activation = config.activation
        glu = 2 if config.activation == "swiglu" else 1
        self.linear_fc1 = nn.Linear(config.hidden_size, glu * config.intermediate_size, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x):
        h = self.linear_fc1(x)
        h = activate(self.activation, *h.chunk(2, dim=-1)) if self.activation == "swiglu" else F.gelu(h)
        return self.linear_fc2(h)


class Router(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.router_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def _topk(self, selection: torch.Tensor):
        c, k = self.config, self.config.num_experts_per_tok
        if not c.router_num_groups:
            return torch.topk(selection, k, dim=-1).indices
        tokens, experts = selection.shape
        grouped = selection.view(tokens, c.router_num_groups, experts // c.router_num_groups)
        if c.router_group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(k // c.router_group_topk, dim=-1).values.sum(dim=-1)
        chosen = torch.topk(group_scores, c.router_group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        return torch.topk(selection.masked_fill(~keep, float("-inf")), k, dim=-1).indices

    def forward(self, x: torch.Tensor):
        """x [tokens, hidden] -> (indices, weights) [tokens, k]."""
        c = self.config
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        if c.router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            selection = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
            indices = self._topk(selection)
            weights = scores.gather(-1, indices)
        elif c.router_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            indices = self._topk(scores)
            weights = scores.gather(-1, indices)
        else:
            indices = self._topk(logits)
            weights = torch.softmax(logits.gather(-1, indices), dim=-1)
        if c.router_renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * c.router_topk_scaling_factor


class Experts(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.activation = config.activation
        shape = (config.num_experts, config.moe_intermediate_size, config.hidden_size)
        self.w1 = nn.Parameter(torch.empty(shape))
        self.v1 = nn.Parameter(torch.empty(shape)) if config.activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(shape))

    def forward(self, x, indices, weights):
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            rows, slots = (indices == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            h2 = xe @ self.v1[e].t() if self.v1 is not None else None
            y = activate(self.activation, xe @ self.w1[e].t(), h2) @ self.w2[e]
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(x.dtype))
        return out


class SharedExperts(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.activation = config.activation
        shape = (config.shared_expert_intermediate_size, config.hidden_size)
        self.w1 = nn.Parameter(torch.empty(shape))
        self.v1 = nn.Parameter(torch.empty(shape)) if config.activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(shape))
        self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size)) if config.shared_expert_gate else None

    def forward(self, x):
        h2 = F.linear(x, self.v1) if self.v1 is not None else None
        y = F.linear(activate(self.activation, F.linear(x, self.w1), h2), self.w2.t())
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y


class MoE(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.shared_experts = SharedExperts(config) if config.shared_expert_intermediate_size else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.router(flat)
        out = self.experts(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self, config: DmoeGptConfig, layer: int):
        super().__init__()
        self.input_layernorm = Norm(config.hidden_size, config)
        self.self_attention = Attention(config, layer)
        self.pre_mlp_layernorm = Norm(config.hidden_size, config)
        self.mlp = MoE(config) if layer in config.moe_layers else MLP(config)

    def forward(self, x, positions, mask, cache):
        x = x + self.self_attention(self.input_layernorm(x), positions, mask, cache)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.position_embeddings = None

    def forward(self, input_ids, positions):
        x = self.word_embeddings(input_ids)
        return x if self.position_embeddings is None else x + self.position_embeddings(positions)


class Decoder(nn.Module):
    def __init__(self, config: DmoeGptConfig):
        super().__init__()
        self.layers = nn.ModuleList([Layer(config, i) for i in range(config.num_hidden_layers)])
        self.final_layernorm = Norm(config.hidden_size, config)


class DmoeGptPreTrainedModel(PreTrainedModel):
    config_class = DmoeGptConfig
    base_model_prefix = ""
    _no_split_modules = ["Layer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        # loaded weights replace these; a fresh model starts as megatron-core's does
        std = self.config.initializer_range
        with torch.no_grad():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, Norm):
                    param.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    param.zero_()
                else:
                    param.normal_(0.0, std)


class DmoeGptForCausalLM(DmoeGptPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"output_layer.weight": "embedding.word_embeddings.weight"}

    def __init__(self, config: DmoeGptConfig):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.decoder = Decoder(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def get_output_embeddings(self):
        return self.output_layer

    def set_output_embeddings(self, value):
        self.output_layer = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if inputs_embeds is not None:
            raise ValueError("DmoeGptForCausalLM takes input_ids (inputs_embeds is not supported)")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        batch, seq = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=input_ids.device).expand(batch, seq)
        # causal over the cached and new positions; padding (attention_mask 0) never attended to
        keys = torch.arange(past + seq, device=input_ids.device)
        mask = keys[None, :] <= (keys[past:, None])  # [seq, past + seq]
        mask = mask[None, None].expand(batch, 1, seq, past + seq)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -(past + seq):].bool()
        x = self.embedding(input_ids, position_ids)
        for layer in self.decoder.layers:
            x = layer(x, position_ids, mask, cache)
        x = self.decoder.final_layernorm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.output_layer(x).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})


__all__ = ["DmoeGptConfig", "DmoeGptForCausalLM"]
