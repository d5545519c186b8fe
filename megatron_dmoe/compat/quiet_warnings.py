"""Warnings that no user of megatron_dmoe can act on, dropped for dmoe-train.

- torch's FutureWarning that `all_gather_into_tensor` and `reduce_scatter_tensor` are deprecated:
  megatron-core (0.16 through 0.19) calls them; upstream would have to call the `_single` forms.
- torch's UserWarning that the `.grad` of a tensor that is not a leaf is read: megatron-core's
  optimizers look for `.grad` on every parameter they hold, the distributed optimizer's shard
  views included.
- megatron-core 0.19's UserWarning, at import, that its MimoModelConfig is experimental: nothing
  here uses it; upstream would have to warn where it is used, not where it is defined.
- without CUDA, megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1 for sequence
  parallelism (it concerns the overlap of CUDA kernels; on GPUs it stays).
"""
from __future__ import annotations

import warnings

_ALWAYS = (
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
    (r"MimoModelConfig is experimental", UserWarning),
)
_WITHOUT_CUDA = (
    (r"When using sequence parallelism it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
)


def quiet_unactionable_warnings(on_cuda: bool) -> None:
    """Install the filters above (idempotent: warnings.filterwarnings replaces an equal filter)."""
    for message, category in _ALWAYS + (() if on_cuda else _WITHOUT_CUDA):
        warnings.filterwarnings("ignore", message=message, category=category)
