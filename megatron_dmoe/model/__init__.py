"""megatron-core integration: layer specs, GPT building, fast attention, CPU compatibility."""
