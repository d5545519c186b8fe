"""megatron-core integration: layer specs, GPT building, fast attention, fused norms, linears and loss."""

