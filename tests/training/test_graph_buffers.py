"""megatron-core 0.16's graph runners return a layer's input buffer to the reuse pool right after
its forward capture; compat/graph_buffers.py holds it until that runner's backward is captured.
Checked on CPU with stand-ins for the two capture methods that use megatron's own TensorReusePool
the way its runners do (an input buffer taken and given back early in the forward, the incoming
gradient buffer taken in the backward)."""
import types

import pytest
import torch

cuda_graphs = pytest.importorskip("megatron.core.transformer.cuda_graphs")
if not hasattr(cuda_graphs, "TensorReusePool"):
    pytest.skip("this megatron-core has no TensorReusePool (nothing to hold)", allow_module_level=True)

from megatron_dmoe.compat.graph_buffers import hold_inputs_until_backward  # noqa: E402

META = cuda_graphs.ArgMetadata(torch.zeros(4, 3))


def _create_fwd_graph(runner):
    pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
    runner.input_buffer = pool.get(META)  # the layer's saved input lives here
    pool.insert(runner.input_buffer)  # megatron 0.16's early return


def _create_bwd_graph(runner):
    runner.grad_buffer = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool.get(META)


@pytest.fixture
def fresh_pool(monkeypatch):
    pool_class = cuda_graphs.TensorReusePool
    for name, value in (("pool", []), ("tensor_strong_refs", []), ("tensor_strong_refs_dataptrs", set())):
        monkeypatch.setattr(pool_class, name, value)
    monkeypatch.setattr(cuda_graphs._CudagraphGlobalRecord, "tensor_reuse_pool", pool_class())
    runner_class = cuda_graphs._CudaGraphRunner
    monkeypatch.setattr(runner_class, "create_fwd_graph", _create_fwd_graph)
    monkeypatch.setattr(runner_class, "create_bwd_graph", _create_bwd_graph)
    monkeypatch.setattr(runner_class, "_holds_inputs", False, raising=False)
    return runner_class


def _capture(runner_class, order):
    """order: ("F" | "B", runner index); returns the runners."""
    runners = [types.SimpleNamespace() for _ in range(1 + max(i for _, i in order))]
    for kind, i in order:
        (runner_class.create_fwd_graph if kind == "F" else runner_class.create_bwd_graph)(runners[i])
    return runners


# two micro-batches in flight: both forwards are captured before the first backward
ORDER = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_unpatched_pool_hands_a_saved_input_on(fresh_pool):
    first, second = _capture(fresh_pool, ORDER)
    # what made captured gradients wrong: one buffer is both runners' saved input and a gradient buffer
    assert first.input_buffer is second.input_buffer is first.grad_buffer


def test_inputs_are_held_until_their_backward_is_captured(fresh_pool):
    hold_inputs_until_backward()
    hold_inputs_until_backward()  # idempotent: patched once
    first, second = _capture(fresh_pool, ORDER)
    assert first.input_buffer is not second.input_buffer
    assert first.grad_buffer is not first.input_buffer and first.grad_buffer is not second.input_buffer
    # once the first runner's backward is captured its input buffer is free for later graphs
    assert second.grad_buffer is first.input_buffer
    assert second.input_buffer in cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool.pool
