"""Transformer layers as CUDA graphs (`training.cuda_graphs`), through megatron-core's local
implementation: during the first training step every layer runs eagerly and records the order of
its forward and backward; after that step's optimizer update `capture_layer_graphs` captures them all
into one memory pool, and later steps replay them, so the host issues one graph launch per layer
and direction instead of every kernel.

Where capture is correct is written down in config/cuda_graphs_rules.py: validation refuses `true`
elsewhere, and `auto`, the default, becomes true or false once at start-up (model/cuda_graphs_auto.py,
called by the run's set-up).

What the layers do besides computing must be graph-safe: the MoE metrics and the aux-loss scale
live in device buffers updated in place (moe/metrics.py, moe/aux_loss.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


def _uses_layer_graphs(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "cuda_graph_impl", "none") == "local"


def capture_layer_graphs(chunks: Sequence[torch.nn.Module], moe_metrics=None) -> None:
    """Capture the layers recorded since the graphs were last released (a no-op once captured, or
    when the model does not use layer graphs). Call after a step's optimizer update, with every model
    chunk (megatron captures the records of all of them at once).

    Before capturing, megatron runs each layer forward and backward on zero inputs to warm up; the
    state layers update in place (`moe_metrics`, the run's MoEMetrics; router load counters; any
    module buffer) is put back afterwards, so those runs do not count as training."""
    if not any(_uses_layer_graphs(chunk) for chunk in chunks):
        return
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, create_cudagraphs

    if not _CudagraphGlobalRecord.cudagraph_record:
        return  # captured already, or nothing recorded
    # nn.Module.buffers: megatron's DDP wrapper has a `buffers` attribute of its own (its grad buffers)
    metrics = moe_metrics.tensors() if moe_metrics is not None else []
    state = [*metrics, *(b for chunk in chunks for b in torch.nn.Module.buffers(chunk))]
    saved = [t.clone() for t in state]
    # the graphs' pool is private: blocks the eager first step left cached in the shared pool (its
    # activations) cannot serve it, and on an 80 GB card the two together did not fit
    torch.cuda.empty_cache()
    create_cudagraphs()
    with torch.no_grad():
        for t, value in zip(state, saved):
            t.copy_(value)


@contextlib.contextmanager
def capture_after_schedule(chunks) -> Iterator[None]:
    """megatron-core's forward-backward schedules capture the recorded layers themselves at the end
    of a step (`create_cudagraphs`); inside this block they leave that to the caller, who captures
    with `capture_layer_graphs` once the step's deferred expert weight gradients are done, so the
    warm-up runs touch neither those nor the MoE metrics and module buffers."""
    from megatron.core.pipeline_parallel import schedules

    if not any(_uses_layer_graphs(chunk) for chunk in chunks):
        yield
        return
    original = schedules.create_cudagraphs
    schedules.create_cudagraphs = lambda *args, **kwargs: None
    try:
        yield
    finally:
        schedules.create_cudagraphs = original


def release_layer_graphs(chunks: Sequence[torch.nn.Module] = ()) -> None:
    """Drop the captured graphs of `chunks` and megatron's global capture record: before building
    another model in this process, and before the process groups are destroyed at a run's end,
    since graphs holding tensor-parallel NCCL kernels keep their communicators busy (a captured
    TP 2 run trained to its end and then waited in destroy_process_group until killed)."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, delete_cuda_graphs

    for chunk in chunks:
        for module in chunk.modules():
            manager = module._modules.get("cudagraph_manager")
            for runner in getattr(manager, "cudagraph_runners", ()):
                runner.fwd_graph = runner.bwd_graph = None
    if CudaGraphManager.global_mempool is not None:
        delete_cuda_graphs()


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module) -> Iterator[None]:
    """Run the layers eagerly inside the block (evaluation): a replayed training graph would
    record MoE metrics and router load for forwards that are not training."""
    hidden = {m: m._modules["cudagraph_manager"] for m in list(model.modules())
              if m._modules.get("cudagraph_manager") is not None}
    for module in hidden:
        delattr(module, "cudagraph_manager")  # megatron's layers check hasattr before using it
    try:
        yield
    finally:
        for module, manager in hidden.items():
            module.cudagraph_manager = manager
