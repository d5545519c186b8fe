"""Transformer layers as CUDA graphs (`training.cuda_graphs`), through megatron-core's local
implementation: during the first training step every layer runs eagerly and records the order of
its forward and backward; after that step's optimizer update `capture_layer_graphs` captures them all
into one memory pool, and later steps replay them, so the host issues one graph launch per layer
and direction instead of every kernel.

Where capture is correct is written down in config/cuda_graphs_rules.py: validation refuses `true`
elsewhere, and `auto`, the default, becomes true or false once at start-up (model/cuda_graphs_auto.py,
called by the run's set-up).

What the layers do besides computing must be graph-safe: the MoE metrics and the aux-loss scale
live in device buffers updated in place (moe/metrics.py, moe/aux_loss.py). Where megatron-core
0.16 hands a layer's input buffer on before its backward has read it, compat/graph_buffers.py
holds it; a captured run's optimizer state is made before the recording step (training/optim.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dmoe.compat.graph_buffers import hold_inputs_until_backward
from megatron_dmoe.compat.schedule_capture import schedules_leave_capture


def _graph_managers(chunks: Sequence[torch.nn.Module]) -> dict:
    """{module: its megatron CudaGraphManager} over every module of `chunks`."""
    return {m: m._modules["cudagraph_manager"] for chunk in chunks for m in list(chunk.modules())
            if m._modules.get("cudagraph_manager") is not None}


def _uses_layer_graphs(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "cuda_graph_impl", "none") == "local"


def capture_layer_graphs(chunks: Sequence[torch.nn.Module], moe_metrics=None,
                         first_step: Optional["FirstStepMemory"] = None) -> None:
    """Capture the layers recorded since the graphs were last released (a no-op once captured, or
    when the model does not use layer graphs). Call after a step's optimizer update, with every model
    chunk (megatron captures the records of all of them at once).

    Before capturing, megatron runs each layer forward and backward on zero inputs to warm up; the
    state layers update in place (`moe_metrics`, the run's MoEMetrics; router load counters; any
    module buffer) is put back afterwards, so those runs do not count as training.

    first_step (training.cuda_graphs: auto): the recording step's memory. Where the graphs' pool
    would not fit in the room an eager step leaves on any rank's GPU, nothing is captured: the layers
    run eagerly from now on, with one note. The pool is private, so the shared one cannot reuse its
    free blocks: a model whose eager steps nearly filled the card captured a pool of about one
    micro-batch's activations and ran out of memory on the next step, and still did with its graphs
    dropped after capture (docs/archive/moe_notes.md, "Capture after the optimizer update, and `auto`'s
    memory check")."""
    if not any(_uses_layer_graphs(chunk) for chunk in chunks):
        return
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, create_cudagraphs

    if not _CudagraphGlobalRecord.cudagraph_record:
        return  # captured already, or nothing recorded
    if first_step is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        room, need = total - first_step.next_peak(), first_step.need()
        if not _on_every_rank(need <= room):
            _drop_layer_graphs(chunks)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"note: training.cuda_graphs: auto runs the layers eagerly: their captured graphs' memory "
                      f"pool (about {need / 2**30:.1f} GiB) would not fit in the room an eager step leaves on a "
                      f"GPU ({room / 2**30:.1f} of {total / 2**30:.1f} GiB) (training.cuda_graphs=false skips "
                      "recording them)", flush=True)
            return
    metrics = moe_metrics.tensors() if moe_metrics is not None else []
    # nn.Module.buffers: megatron's DDP wrapper has a `buffers` attribute of its own (its grad buffers)
    state = [*metrics, *(b for chunk in chunks for b in torch.nn.Module.buffers(chunk))]
    saved = [t.clone() for t in state]
    torch.cuda.empty_cache()  # the eager step's cached blocks go back, so the pool can take them
    hold_inputs_until_backward()
    create_cudagraphs()
    with torch.no_grad():
        for t, value in zip(state, saved):
            t.copy_(value)


def layer_graphs_pending() -> bool:
    """Whether layers have been recorded and wait for `capture_layer_graphs` (the first step)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    return bool(_CudagraphGlobalRecord.cudagraph_record)


class FirstStepMemory:
    """What the first (recording) step tells of memory, to decide before capturing whether the
    graphs' pool fits: made before the optimizer update, from the bytes allocated at the step's start.

    need: the pool takes about one micro-batch's activations, the step's forward/backward peak over
    its start; next_peak: an eager step's peak, that peak plus what the update keeps (any optimizer
    state the first update creates: dmoe-train makes Adam's before the step, bench_train too)."""

    def __init__(self, start: int):
        self._start = start
        self._peak = torch.cuda.max_memory_allocated()
        self._before = torch.cuda.memory_allocated()

    def need(self) -> int:
        return self._peak - self._start

    def next_peak(self) -> int:
        return self._peak + max(0, torch.cuda.memory_allocated() - self._before)


def _on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (captured layers hold collectives: all ranks decide alike)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([0 if flag else 1], device=torch.cuda.current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item() == 0


def _drop_layer_graphs(chunks: Sequence[torch.nn.Module]) -> None:
    """Release the graphs and megatron's record (the recording step's layer inputs with it), and take
    the layers' graph managers away for good: megatron's layers run eagerly where they have none."""
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    managers = _graph_managers(chunks)
    _reset_runners(managers.values())
    delete_cuda_graphs()  # also before any capture, when megatron has no pool yet
    for module in managers:
        delattr(module, "cudagraph_manager")


def uses_captured_layers(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether any layer of `chunks` still runs through a graph manager."""
    return bool(_graph_managers(chunks))


def _reset_runners(managers) -> None:
    # megatron's delete_cuda_graphs reaches only the runners still in its record, which capture empties
    for manager in managers:
        for runner in getattr(manager, "cudagraph_runners", ()):
            runner.fwd_graph = runner.bwd_graph = None


@contextlib.contextmanager
def capture_after_schedule(chunks) -> Iterator[None]:
    """megatron-core's forward-backward schedules capture the recorded layers themselves at the end
    of a step (`create_cudagraphs`); inside this block they leave that to the caller, who captures
    with `capture_layer_graphs` once the step's deferred expert weight gradients are done, so the
    warm-up runs touch neither those nor the MoE metrics and module buffers (megatron-core has no
    option for it: compat/schedule_capture.py)."""
    if not any(_uses_layer_graphs(chunk) for chunk in chunks):
        yield
        return
    with schedules_leave_capture():
        yield


def release_layer_graphs(chunks: Sequence[torch.nn.Module] = ()) -> None:
    """Drop the captured graphs of `chunks` and megatron's global capture record: before building
    another model in this process, and before the process groups are destroyed at a run's end,
    since graphs holding tensor-parallel NCCL kernels keep their communicators busy (a captured
    TP 2 run trained to its end and then waited in destroy_process_group until killed)."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, delete_cuda_graphs

    _reset_runners(_graph_managers(chunks).values())
    if CudaGraphManager.global_mempool is not None:
        delete_cuda_graphs()


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module) -> Iterator[None]:
    """Run the layers eagerly inside the block (evaluation): a replayed training graph would
    record MoE metrics and router load for forwards that are not training."""
    hidden = _graph_managers([model])
    for module in hidden:
        delattr(module, "cudagraph_manager")  # megatron's layers check hasattr before using it
    try:
        yield
    finally:
        for module, manager in hidden.items():
            module.cudagraph_manager = manager
