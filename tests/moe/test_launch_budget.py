"""The sparse layer's launches per forward and backward, counted on CPU: every aten op that would
launch a kernel on a GPU, and every Triton kernel launch (through Triton's interpreter here).

On small experts the layer is bound by the host, which pays per launch (docs/performance.md, "Host
time and launches"), so the count is a budget: a change that adds launches fails here and must
update the numbers on purpose. The GPU path is mirrored where it differs on CPU: the topology is
built by its Triton kernels and the router is the fused one (both CUDA's choice)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dmoe.moe import MoELayer
from moe_reference import make_config

# Ops that launch nothing on a GPU: views, metadata and uninitialised allocations.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "expand", "slice", "select", "detach", "alias",
    "as_strided", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "unbind", "view_as",
    "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_",
    "promote_types", "is_same_size", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride",
}
# The budget (GELU experts, top-2, micro-batch load-balancing loss, no padding tokens). Forward: the
# router GEMM and fused router, the counting sort and topology (6), the permutation, the loss with
# the metrics' running sums (1), the two products (GELU in the first one's epilogue), the combine.
# Backward: the permutation's, experts' and combine's (8: the router weights' gradient summed in the
# launch that sums dx back), the loss's (1), the fused router's, the router GEMM's two and the sum of the
# input's two gradients.
FORWARD_LAUNCHES = 13
BACKWARD_LAUNCHES = 13
# The backward as a training step runs it eagerly, expert weight gradients into main_grad over a
# window of 4 micro-batches (moe.expert_wgrad_window; the activation's backward stores the left
# operands into the slots itself): in place of its weight-gradient product each expert weight
# stashes its right operand with its expert offsets (1), and the window's product runs at the
# micro-batch that fills it (1), with no launch for the counter (the host knows it).
WINDOW = 4
WINDOWED_BACKWARD_LAUNCHES = [13, 13, 13, 15]


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.in_triton and name not in NO_LAUNCH:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("counts launches through Triton's interpreter, which tests/conftest.py sets up only without a GPU")
    """A _Counter that also records each Triton launch (and not the interpreter's own torch ops)."""
    from triton.runtime import interpreter

    import dmoe_kernels as dk

    counter = _Counter()
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        counter.names.append(f"triton:{self.fn.__name__}")
        counter.in_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.in_triton -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    build = dk.Topology.for_experts  # bound to the class

    def for_experts(*args, **kwargs):
        return build(*args, **{**kwargs, "builder": "triton"})  # CUDA's builder

    monkeypatch.setattr(dk.Topology, "for_experts", staticmethod(for_experts))
    return counter


@pytest.mark.slow
def test_sparse_layer_launch_budget(counted):
    torch.manual_seed(0)
    config = make_config(32, 64, 4, 2, dtype=torch.float32, moe_aux_loss_coeff=0.01)
    layer = MoELayer(config, backend="sparse", block_size=16, router_impl="fused").train()
    layer.run_state.metrics.megatron_tracker = False  # as in dmoe-train
    x = torch.randn(24, 2, 32, requires_grad=True)
    dy = torch.randn(24, 2, 32)
    out, _ = layer(x)  # first call: backends and dispatchers resolved, nothing cached counted
    out.backward(dy)
    for p in layer.parameters():
        p.grad = None  # the counted backward assigns gradients, as the first of a step does
    x.grad = None
    counted.names.clear()
    with counted:
        out, _ = layer(x)
        forward = list(counted.names)
        out.backward(dy)
    backward = counted.names[len(forward):]
    assert len(forward) == FORWARD_LAUNCHES, f"forward launches {len(forward)}: {forward}"
    assert len(backward) == BACKWARD_LAUNCHES, f"backward launches {len(backward)}: {backward}"


@pytest.mark.slow
def test_windowed_backward_launch_budget(counted):
    from megatron_dmoe.parallel import param_roles

    torch.manual_seed(0)
    config = make_config(32, 64, 4, 2, dtype=torch.float32, moe_aux_loss_coeff=0.01)
    layer = MoELayer(config, backend="sparse", block_size=16, router_impl="fused").train()
    layer.run_state.metrics.megatron_tracker = False
    experts = [layer.experts.w1, layer.experts.w2]
    for p in experts:  # as dmoe-train's DDP leaves them: fp32 main_grad, reduced after backward
        p.main_grad = torch.zeros(p.shape)
        param_roles.set_main_grad_only(p, True)
    stash = layer.run_state.wgrad
    stash.use_window(WINDOW)
    x = torch.randn(24, 2, 32, requires_grad=True)
    dy = torch.randn(24, 2, 32)
    for _ in range(WINDOW):  # a first step: backends resolved, the window's slots made
        layer(x)[0].backward(dy)
    counts = []
    stash.main_grads_zeroed()
    for _ in range(WINDOW):
        out, _ = layer(x)
        for p in layer.parameters():
            p.grad = None  # as the first backward of a step: gradients assigned, not added
        x.grad = None
        counted.names.clear()
        with counted:
            out.backward(dy)
        counts.append(list(counted.names))
    assert [len(c) for c in counts] == WINDOWED_BACKWARD_LAUNCHES, "\n".join(map(str, counts))
    assert [sum(n == "triton:dsdt_window_kernel" for n in c) for c in counts] == [0] * (WINDOW - 1) + [2]
    assert all(p.main_grad.abs().sum() > 0 for p in experts)  # the window's sum arrived
