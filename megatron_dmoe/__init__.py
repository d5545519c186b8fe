"""Dropless Mixture-of-Experts training on megatron-core."""
from megatron_dmoe.compat.eager_fusions import fuse_only_with_cuda as _fuse_only_with_cuda
from megatron_dmoe.compat.mcore import quiet_notices as _quiet_notices

# megatron-core's notices that no user here can act on, silenced before any of this package's modules
# imports it (only those that use it do: the run configuration, megatron_dmoe.config, stays light);
# and on machines without CUDA, its fusions left uncompiled (compat/eager_fusions.py)
_quiet_notices()
_fuse_only_with_cuda()
