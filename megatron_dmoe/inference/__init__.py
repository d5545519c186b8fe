"""Using a trained run: load its checkpoint, evaluate it, generate text with it (see also
megatron_dmoe.export for transformers' formats)."""
