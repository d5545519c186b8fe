"""The shipped YAML experiments; a package only so that they install with megatron_dmoe."""
