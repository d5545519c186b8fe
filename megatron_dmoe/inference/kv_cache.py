"""megatron-core's static key-value cache (StaticInferenceContext), usable on a CPU.

megatron's attention allocates each layer's cache buffers on `torch.cuda.current_device()` the first
time it sees the context. Handing it buffers already allocated on the model's device (for every
attention layer, under the layer number it looks them up by) skips that allocation, so the same
incremental decoding runs on CPUs and GPUs.
"""
from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.attention import Attention


def static_kv_cache(
    model, batch_size: int, max_length: int, device: torch.device, dtype: torch.dtype
) -> StaticInferenceContext:
    """A StaticInferenceContext for `model` with its key/value buffers allocated on `device`."""
    context = StaticInferenceContext(batch_size, max_length)
    for module in model.modules():
        if isinstance(module, Attention):
            groups = module.num_query_groups_per_partition
            context.key_value_memory_dict[module.layer_number] = (
                torch.empty(max_length, batch_size, groups, module.key_hidden_size, dtype=dtype, device=device),
                torch.empty(max_length, batch_size, groups, module.val_hidden_size, dtype=dtype, device=device),
            )
    return context
