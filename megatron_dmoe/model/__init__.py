"""megatron-core integration: layer specs, GPT building, fast attention, fused kernels for norms, linears and the loss."""
