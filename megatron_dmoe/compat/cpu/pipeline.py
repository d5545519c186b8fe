"""Pipeline parallelism on gloo.

Needed by megatron-core 0.16 through 0.19 (checked: 0.16.1, 0.19.1): its schedules count tokens
in a tensor made on 'cuda', its point-to-point exchange allocates receive buffers on the current
CUDA device and synchronises it, and the last stage's copy of tied embeddings is moved with
`.cuda()` before its first all-reduce. Could go once upstream makes those tensors on the device of
the activations (or of the process group) and moves the embedding copy to the model's device.
"""
from __future__ import annotations

import functools

from megatron_dmoe.compat.cpu.devices import TorchOnCpu, tensor_cuda_is_identity


def pipeline_on_host() -> None:
    """Apply once (compat/cpu/__init__.py's apply_cpu_compat guards against a second time)."""
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    shim = TorchOnCpu()
    schedules.torch = shim
    p2p_communication.torch = shim
    module = language_module.LanguageModule
    setup = module.setup_embeddings_and_output_layer

    @functools.wraps(setup)
    def setup_on_cpu(self, *args, **kwargs):
        with tensor_cuda_is_identity():  # a no-op unless the run is on the host
            return setup(self, *args, **kwargs)

    module.setup_embeddings_and_output_layer = setup_on_cpu
