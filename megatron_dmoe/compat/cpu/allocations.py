"""megatron-core's buffers made on the current CUDA device, made on the host in a CPU run.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1), whose global memory buffer
(unfused attention's scratch), DDP's gradient buffers and RoPE's frequency table allocate on
`torch.cuda.current_device()`, and whose default causal mask is made on 'cuda', whatever device
the model's tensors are on. Multi-latent attention makes its RoPE (plain or YaRN) without
`use_cpu_initialization`, and YaRN's table moves its frequencies to the current device. Could go
once upstream allocates on the device of the tensors it is given (or honours
`use_cpu_initialization` there, as RoPE's constructor already does).
"""
from __future__ import annotations

import torch

from megatron_dmoe.compat.cpu.devices import host_only, run_on_cpu


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def allocate_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.transformer import multi_latent_attention, utils as transformer_utils

    mcore_utils.GlobalMemoryBuffer.get_tensor = run_on_cpu(mcore_utils.GlobalMemoryBuffer.get_tensor)
    grad_buffer = param_and_grad_buffer._ParamAndGradBuffer
    grad_buffer.__init__ = run_on_cpu(grad_buffer.__init__)
    rope = rotary_pos_embedding.RotaryEmbedding
    rope.get_emb = run_on_cpu(rope.get_emb)
    yarn = yarn_rotary_pos_embedding.YarnRotaryEmbedding
    yarn.get_emb = run_on_cpu(yarn.get_emb)
    mla = multi_latent_attention.MultiLatentAttention
    mla.__init__ = run_on_cpu(mla.__init__)
    for module in (transformer_utils, fused_softmax):
        module.get_default_causal_mask = host_only(_cpu_causal_mask, module.get_default_causal_mask)
