"""Dropless Mixture-of-Experts training on megatron-core."""
import warnings as _warnings

from megatron_dmoe.compat.mcore import quiet_notices as _quiet_notices

# megatron-core's release notices (logging) that no user here can act on; before the import below,
# which already emits one of them (torch's cpp_extension on a CPU machine, with megatron-core 0.19)
_quiet_notices()

with _warnings.catch_warnings():
    # megatron-core says at import, four times, that Transformer Engine and apex are not installed:
    # both are optional here and nothing needs them. Imported once, here, it stays quiet after.
    _warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    _warnings.filterwarnings("ignore", message="Apex is not installed")
    import megatron.core  # noqa: F401
