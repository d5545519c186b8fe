"""Multi-latent attention without a query latent (q_lora_rank None) and with latent norms
(qk_layernorm), from megatron-core's local modules, as 0.16 builds it: the query projection reads
the layer's normed input as it is.

Needed from megatron-core 0.19 (checked: 0.19.1), whose MLASelfAttention resolves its norms
(QKNormConfigResolver) and, for this case, refuses the local spec's query norm slot ("non-trivial,
but q_lora_rank is None") and, with that slot empty, asks for a fused norm+linear query projection
(a second norm of the input, Transformer Engine's module; the local backend has none). Either way
the build fails. DeepSeek-V2-Lite's attention is this case. Could go once upstream builds the plain
projection with local modules.
"""
from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class PlainQueryProjectionMLA(MLASelfAttention):
    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
            return super()._resolve_qk_norm_config(submodules)
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                    kv_layernorm=submodules.kv_layernorm)
