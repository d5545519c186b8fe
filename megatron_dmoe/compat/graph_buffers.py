"""Keep a captured layer's input buffer out of megatron-core's reuse pool until its backward is captured.

megatron-core 0.16's local CUDA graphs copy a layer's outside input (the embedding's output, a
pipeline receive) into a static buffer from `TensorReusePool`, and put that buffer back into the
pool as soon as the layer's forward graph is captured. But the forward's saved tensors still live
there (the input norm keeps its input for backward), and the pool hands the buffer on: to later
graphs' inputs and to the incoming-gradient buffer of a model chunk's last layer, whose backward
replay copies its output gradient over it. The first layer of every chunk then computes its norm's
backward from the wrong input: forwards and losses stay exact, gradients do not (docs/performance.md,
"CUDA-graph input buffers under megatron-core 0.16"). Megatron-LM later removed that early
return; 0.19 has no TensorReusePool and needs nothing here.

Held buffers go back to the pool once their runner's backward graph is captured: graphs captured
after it replay after it too, so the backward has read them by the time anyone writes there.
"""
from __future__ import annotations

_HELD = "_inputs_awaiting_backward"


def hold_inputs_until_backward() -> None:
    """Patch megatron-core's graph runner where it has the early return (idempotent, a no-op elsewhere)."""
    from megatron.core.transformer import cuda_graphs

    runner_class = cuda_graphs._CudaGraphRunner
    if not hasattr(cuda_graphs, "TensorReusePool") or getattr(runner_class, "_holds_inputs", False):
        return
    create_fwd_graph, create_bwd_graph = runner_class.create_fwd_graph, runner_class.create_bwd_graph

    def create_fwd_graph_holding_inputs(runner, *args, **kwargs):
        pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
        held = []
        pool.insert = held.append  # the forward's only return to the pool is the early one
        try:
            return create_fwd_graph(runner, *args, **kwargs)
        finally:
            del pool.insert
            setattr(runner, _HELD, held)

    def create_bwd_graph_then_release(runner, *args, **kwargs):
        out = create_bwd_graph(runner, *args, **kwargs)
        pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
        for buffer in runner.__dict__.pop(_HELD, ()):
            pool.insert(buffer)
        return out

    runner_class.create_fwd_graph = create_fwd_graph_holding_inputs
    runner_class.create_bwd_graph = create_bwd_graph_then_release
    runner_class._holds_inputs = True
