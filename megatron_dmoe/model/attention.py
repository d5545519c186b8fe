"""Core attention on torch's fused scaled-dot-product attention (flash / memory-efficient kernels).

A drop-in for megatron-core's `DotProductAttention` inside the local layer spec: same constructor,
same [s, b, heads, head_dim] inputs and [s, b, hidden] output. megatron's own version materialises
the [b, heads, s, s] score matrix; this one lets torch pick a fused kernel. Causal masking comes from
the mask type, so no mask tensor is built; an explicit attention mask is honoured for other types.

Selective activation recompute (`recompute=True`, training.recompute_granularity: selective) is its
own: a non-reentrant checkpoint around the whole core attention (the heads' layout changes, the
grouped-query copies of keys and values, the kernel), in place of megatron's reentrant one, which
per-layer CUDA graphs cannot capture (megatron captures each layer's backward with
torch.autograd.grad, which a reentrant checkpoint refuses). Without dropout only: its recompute
would have to replay megatron's dropout RNG state, which megatron also refuses to graph.

`ProjectionQKNorm`: OLMoE's query and key norm, over the whole projection rather than per head.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils.checkpoint import checkpoint

from megatron_dmoe.parallel.param_roles import mark_tensor_parallel


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        recompute: bool = False,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use Transformer Engine")
        tp = config.tensor_model_parallel_size
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        # multi-latent attention's queries and keys are wider than its values (k_channels, v_channels)
        k_channels = k_channels or config.kv_channels
        self.head_dim = v_channels or config.kv_channels  # the values' width: the output's per head
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        # apply_query_key_layer_scaling changes nothing here: megatron divides the scale by the
        # layer number and multiplies the scores back by it before its fp32 softmax.
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if recompute and self.dropout_p > 0:
            raise ValueError("SDPAttention recomputes only without attention dropout "
                             f"(attention_dropout is {self.dropout_p})")
        self.recompute = recompute

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.recompute and self.training and torch.is_grad_enabled():
            # keeps only its inputs; preserve_rng_state off: there is no dropout to replay, and
            # reading the CUDA generator's state is not allowed while a graph is captured
            return checkpoint(self._attend, query, key, value, attention_mask, mask_type,
                              use_reentrant=False, preserve_rng_state=False)
        return self._attend(query, key, value, attention_mask, mask_type)

    def _attend(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.groups_per_partition != self.heads_per_partition:
            repeat = self.heads_per_partition // self.groups_per_partition
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        causal = mask_type == AttnMaskType.causal
        # megatron's masks mark positions to DROP with True; SDPA's boolean masks mark positions to KEEP.
        mask = None if causal or attention_mask is None else ~attention_mask
        dropout_p = self.dropout_p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale
            )
        # [b, n, s, d] -> [s, b, n*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)


class ProjectionQKNorm(MegatronModule):
    """An RMSNorm over all heads of the query (or key) projection at once, as OLMoE normalises them,
    in megatron's q_layernorm / k_layernorm slot (whose own norm, `qk_layernorm`, is per head:
    Qwen3-MoE's form). It gets [s, b, this rank's heads, head_dim]; its weight covers this rank's
    heads ([heads / tp * head_dim], split over the tensor-parallel ranks as the heads are), and the
    mean of squares is over every head of every rank: an all-reduce forward and backward. The run's
    TransformerConfig keeps qk_layernorm off for it (model/transformer_config.py): with it on,
    megatron-core sums every q_layernorm / k_layernorm gradient over the tensor-parallel ranks, which
    would add up different shards here.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, heads: str = "query"):
        super().__init__(config=config)
        if config.normalization != "RMSNorm":
            raise ValueError(f"ProjectionQKNorm is an RMSNorm; the model's normalization is {config.normalization}")
        count = {"query": config.num_attention_heads, "key": config.num_query_groups}[heads]
        self.tp = config.tensor_model_parallel_size
        self.width = count * hidden_size  # over every rank's heads
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(count // self.tp * hidden_size, dtype=config.params_dtype))
        if self.tp > 1:
            mark_tensor_parallel(self.weight, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))  # fp32 statistics (fp64 kept)
        squares = flat.pow(2).sum(dim=-1, keepdim=True)
        if self.tp > 1:
            # the sum over every rank's heads; each rank's output depends on every rank's squares
            squares = tensor_parallel.copy_to_tensor_model_parallel_region(
                tensor_parallel.reduce_from_tensor_model_parallel_region(squares))
        normed = (flat * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
        return (self.weight * normed).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)
