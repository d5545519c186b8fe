"""megatron-core integration: layer specs, GPT building, fast attention, fused norms, linears and loss."""
import warnings as _warnings

with _warnings.catch_warnings():
    # megatron-core's layer specs say at import that apex is not installed (it falls back to torch's
    # norm): apex is optional here, and this package's norms do not use it
    _warnings.filterwarnings("ignore", message="Apex is not installed")
    import megatron.core.models.backends  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
