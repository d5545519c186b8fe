"""Dropless Mixture-of-Experts training on megatron-core."""
from megatron_dmoe.compat.mcore import quiet_notices as _quiet_notices

# megatron-core's notices that no user here can act on, silenced before any of this package's modules
# imports it (only those that use it do: the run configuration, megatron_dmoe.config, stays light)
_quiet_notices()
