"""Warnings that no user of megatron_dmoe can act on, dropped for every dmoe-* command.

- torch's FutureWarning that `all_gather_into_tensor` and `reduce_scatter_tensor` are deprecated:
  megatron-core (0.16 through 0.19) calls them; upstream would have to call the `_single` forms.
- torch's UserWarning that the `.grad` of a tensor that is not a leaf is read: megatron-core's
  optimizers look for `.grad` on every parameter they hold, the distributed optimizer's shard
  views included.
- megatron-core 0.19's UserWarning, at import, that its MimoModelConfig is experimental: nothing
  here uses it; upstream would have to warn where it is used, not where it is defined.
- without CUDA, megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1 for sequence
  parallelism (it concerns the overlap of CUDA kernels; on GPUs it stays).
- megatron-core's advice to enable moe_router_dtype with 32 or more experts: our router computes its
  logits and probabilities in fp32 whatever the model's precision (moe/router.py); upstream reads
  only its own setting.
- megatron-core's notice that a tokenizer's pad id equals another special token's, in the form that
  says megatron-core then masks no pad tokens itself: it has already done what it advises.
- megatron-core's logged notice, when layers are captured as CUDA graphs without Transformer Engine,
  that TE's weak references would let graphs share their input and output buffers: the memory
  estimate and the measured peaks count the buffers as they are; only installing TE changes it.
- megatron-core 0.19's UserWarning that it cannot tell the rank (from torch.distributed, RANK or
  SLURM_PROCID) and takes rank 0: its logging helpers ask before a command has a process group (a
  single process, the launcher's parent), where rank 0 is right.
- torch's warning that an AccumulateGrad node's stream differs from its gradient's: megatron-core's
  DDP keeps every parameter's AccumulateGrad node from when it wraps the model (on the default
  stream), and captured layers run on a stream of their own; upstream would have to take the nodes
  again on the capture stream.
"""
from __future__ import annotations

import logging
import warnings

_ALWAYS = (
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
    (r"MimoModelConfig is experimental", UserWarning),
    (r"Could not determine rank from torch\.distributed, RANK, or SLURM_PROCID", UserWarning),
    (r"Using a large number of experts \(e\.g\. >=32\) without fp32 routing\. Consider enabling "
     r"moe_router_dtype", UserWarning),
    (r"The pad token id in the tokenizer collides with another special token id\..*As such, the training flow "
     r"will avoid masking out any pad tokens", UserWarning),
    (r"The AccumulateGrad node's stream does not match the stream of the node that produced the incoming "
     r"gradient", UserWarning),
)
_TE_WEAK_REFERENCE = "Transformer Engine was not detected while capturing training cudagraphs"
_WITHOUT_CUDA = (
    (r"When using sequence parallelism it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
)


class _DropTEWeakReferenceNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TE_WEAK_REFERENCE)


def quiet_unactionable_warnings(on_cuda: bool) -> None:
    """Install the filters above (idempotent: warnings.filterwarnings replaces an equal filter, and
    the logging filter is added once)."""
    for message, category in _ALWAYS + (() if on_cuda else _WITHOUT_CUDA):
        warnings.filterwarnings("ignore", message=message, category=category)
    graphs_logger = logging.getLogger("megatron.core.transformer.cuda_graphs")
    if not any(isinstance(f, _DropTEWeakReferenceNotice) for f in graphs_logger.filters):
        graphs_logger.addFilter(_DropTEWeakReferenceNotice())
