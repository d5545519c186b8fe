"""Where the supported megatron-core releases differ (see mcore.py)."""
