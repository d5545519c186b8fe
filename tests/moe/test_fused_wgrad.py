"""The sparse backend adds expert weight gradients straight into an fp32 `main_grad`: outside autograd
for parameters marked `main_grad_only` (our DDP wrapper's), else megatron-core's gradient-accumulation
fusion convention (flag the weight for megatron's DDP, return a placeholder); a parameter opts out
with `param_roles.set_fuse_wgrad_accumulation(param, False)`. Checked against the same call on
weights without main_grad (megatron-core's DistributedDataParallel over two micro-batches:
test_fused_wgrad_megatron_ddp.py).

On CPU the kernels run through Triton's interpreter (fp32, fp16)."""
import pytest
import torch

from megatron_dmoe.moe.dispatch.padded import PaddedDispatcher
from megatron_dmoe.moe.experts.sparse import sparse_expert_mlp, sparse_experts_combine
from megatron_dmoe.parallel import param_roles

T, E, K, HIDDEN, FFN, BS = 24, 4, 2, 32, 32, 16
DEAD = 2  # an expert that gets no token: its gradient is zero and must still be added (as zero)


def _routing(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    scores[:, DEAD] = -1.0
    indices = scores.topk(K, dim=-1).indices
    weights = torch.rand(T, K, generator=g)
    return torch.randn(T, HIDDEN, generator=g), indices, weights


def _permute(x, state):
    """x [T, h] into the padded buffer of a `plan` (what the layer's fused function does first)."""
    from dmoe_kernels import permute

    topo = state.topology
    return permute(x, state.positions, topo.shape[0], topo.expert_offsets, state.counts)


def _problem(seed, activation, dtype, device="cpu", kind="expert_mlp"):
    """The input of one call (the padded buffer for expert_mlp, the tokens for combine), routing
    state and weights (w1, v1 or None, w2)."""
    x, indices, weights = _routing(seed)
    x = x.to(device, dtype)
    state = PaddedDispatcher(E, FFN, block_size=BS).plan(indices.to(device), weights.to(device, dtype))
    x_pad = _permute(x, state)
    g = torch.Generator().manual_seed(seed + 1)
    w1, v1, w2 = (0.3 * torch.randn(E, FFN, HIDDEN, generator=g) for _ in range(3))
    v1 = v1 if activation == "swiglu" else None
    return (x if kind == "combine" else x_pad.detach()), state, [None if w is None else w.to(device, dtype)
                                                                 for w in (w1, v1, w2)]


def _call(kind, x, state, params, activation, memory_optimized=False, wgrad_stash=None):
    w1, v1, w2 = params
    if kind == "expert_mlp":
        return sparse_expert_mlp(x, w1, v1, w2, state.topology, activation, memory_optimized, wgrad_stash)
    return sparse_experts_combine(x, w1, v1, w2, state.weights, state.topology, state.positions, state.counts,
                                  activation, memory_optimized, wgrad_stash)


def _leaf_params(weights, main_grad_dtype=None, seed=0, main_grad_only=None, fuse_wgrad_accumulation=None,
                 zero_out_wgrad=None):
    """Parameters from weights; with main_grad_dtype, each gets a random main_grad (as megatron-core's
    DDP gives one) and the roles given (left unset when None)."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for w in weights:
        if w is None:
            params.append(None)
            continue
        p = torch.nn.Parameter(w.clone())
        if main_grad_dtype is not None:
            p.main_grad = torch.randn(w.shape, generator=g).to(w.device, main_grad_dtype)
            p.grad_added_to_main_grad = False
            if main_grad_only is not None:
                param_roles.set_main_grad_only(p, main_grad_only)
            if fuse_wgrad_accumulation is not None:
                param_roles.set_fuse_wgrad_accumulation(p, fuse_wgrad_accumulation)
            if zero_out_wgrad is not None:
                p.zero_out_wgrad = zero_out_wgrad  # megatron-core sets it (shared embeddings); we only read it
        params.append(p)
    return params


def _backward(kind, x_in, state, params, activation, out_grad, memory_optimized=False, wgrad_stash=None):
    x = x_in.clone().requires_grad_()
    y = _call(kind, x, state, params, activation, memory_optimized, wgrad_stash)
    y.backward(out_grad.to(y.device, y.dtype))
    return y, x.grad


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


CASES = [
    ("expert_mlp", "gelu", False, torch.float32),
    ("expert_mlp", "swiglu", True, torch.float16),
    ("combine", "swiglu", False, torch.float32),
    ("combine", "gelu", True, torch.float16),
]


@pytest.mark.parametrize("mode", ["flag", "main_grad_only"])
@pytest.mark.parametrize("kind, activation, memory_optimized, dtype", CASES,
                         ids=[f"{k}-{a}-{'memopt-' if m else ''}{str(d)[6:]}" for k, a, m, d in CASES])
@pytest.mark.slow
def test_weight_gradients_are_added_into_main_grad(kind, activation, memory_optimized, dtype, mode):
    """flag: megatron's convention (placeholder gradient, grad_added_to_main_grad set);
    main_grad_only: the weights enter detached and no gradient tensor ever exists."""
    x, state, weights = _problem(11, activation, dtype, kind=kind)
    rows = T if kind == "combine" else x.shape[0]
    out_grad = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(3))

    plain = _leaf_params(weights)
    y_plain, dx_plain = _backward(kind, x, state, plain, activation, out_grad, memory_optimized)
    fused = _leaf_params(weights, torch.float32, seed=5, main_grad_only=mode == "main_grad_only")
    old = [None if p is None else p.main_grad.clone() for p in fused]
    y_fused, dx_fused = _backward(kind, x, state, fused, activation, out_grad, memory_optimized)

    assert torch.equal(y_fused, y_plain) and torch.equal(dx_fused, dx_plain)
    # fp32 operands: the same fp32 sum; fp16: the unfused gradient was rounded to fp16, the fused one not
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for name, p, q, m0 in zip(("w1", "v1", "w2"), fused, plain, old):
        if p is None:
            continue
        if mode == "flag":
            assert p.grad_added_to_main_grad is True and p.grad.shape == p.shape, name
        else:
            assert p.grad is None and p.grad_added_to_main_grad is False, name  # autograd never saw it
        assert p.main_grad.dtype == torch.float32, name
        assert _rel(p.main_grad - m0, q.grad) < tol, name
        assert torch.equal(p.main_grad[DEAD], m0[DEAD]), name  # an expert without tokens adds zero


def test_main_grad_only_falls_back_when_the_input_needs_no_gradient():
    """Detached weights get a gradient only if backward runs, which needs x to require one."""
    x_pad, state, weights = _problem(22, "gelu", torch.float32)
    out_grad = torch.randn(x_pad.shape[0], HIDDEN, generator=torch.Generator().manual_seed(8))
    plain = _leaf_params(weights)
    y = _call("expert_mlp", x_pad, state, plain, "gelu")
    y.backward(out_grad)
    params = _leaf_params(weights, torch.float32, seed=10, main_grad_only=True)
    old = [None if p is None else p.main_grad.clone() for p in params]
    y = _call("expert_mlp", x_pad, state, params, "gelu")  # x_pad does not require grad
    y.backward(out_grad)
    for p, q, m0 in zip(params, plain, old):
        if p is not None:
            # the flag convention instead: added by the kernel, placeholder handed to autograd
            assert p.grad_added_to_main_grad is True and p.grad is not None
            assert _rel(p.main_grad - m0, q.grad) < 1e-6


@pytest.mark.slow
def test_main_grad_in_the_weights_dtype_is_accumulated_too():
    x, state, weights = _problem(12, "gelu", torch.float16, kind="combine")
    out_grad = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(4))
    plain = _leaf_params(weights)
    _backward("combine", x, state, plain, "gelu", out_grad)
    fused = _leaf_params(weights, torch.float16, seed=6)
    old = [None if p is None else p.main_grad.clone() for p in fused]
    _backward("combine", x, state, fused, "gelu", out_grad)
    for p, q, m0 in zip(fused, plain, old):
        if p is not None:
            assert p.main_grad.dtype == torch.float16 and p.grad_added_to_main_grad
            expected = m0.double() + q.grad.double()
            assert _rel(p.main_grad, expected) < 2e-3


@pytest.mark.parametrize("how", ["opt-out", "non-contiguous-main-grad", "other-dtype-main-grad"])
@pytest.mark.slow
def test_unfused_weights_keep_main_grad_and_get_the_real_gradient(how):
    x_pad, state, weights = _problem(13, "swiglu", torch.float32)
    out_grad = torch.randn(x_pad.shape[0], HIDDEN, generator=torch.Generator().manual_seed(5))
    plain = _leaf_params(weights)
    _backward("expert_mlp", x_pad, state, plain, "swiglu", out_grad)
    if how == "opt-out":
        params = _leaf_params(weights, torch.float32, seed=7, fuse_wgrad_accumulation=False)
    else:
        params = _leaf_params(weights, torch.float32, seed=7)
        for p in params:
            if how == "non-contiguous-main-grad":
                p.main_grad = p.main_grad.transpose(1, 2).contiguous().transpose(1, 2)
            else:
                p.main_grad = p.main_grad.double()
    old = [p.main_grad.clone() for p in params]
    for p in params:
        param_roles.set_grad_added_to_main_grad(p, True)  # as an earlier fused micro-batch left it: must be cleared
    _backward("expert_mlp", x_pad, state, params, "swiglu", out_grad)
    for p, q, m0 in zip(params, plain, old):
        assert torch.equal(p.main_grad, m0)
        assert p.grad_added_to_main_grad is False
        assert torch.equal(p.grad, q.grad)


@pytest.mark.slow
def test_zero_out_wgrad_gets_a_zero_placeholder():
    """megatron's `zero_out_wgrad` parameters have DDP add the returned gradient anyway: it must be zero."""
    x, state, weights = _problem(14, "gelu", torch.float32, kind="combine")
    out_grad = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(6))
    plain = _leaf_params(weights)
    _backward("combine", x, state, plain, "gelu", out_grad)
    params = _leaf_params(weights, torch.float32, seed=8, zero_out_wgrad=True)
    old = [None if p is None else p.main_grad.clone() for p in params]
    _backward("combine", x, state, params, "gelu", out_grad)
    for p, q, m0 in zip(params, plain, old):
        if p is not None:
            assert p.grad_added_to_main_grad and torch.count_nonzero(p.grad) == 0
            # the real gradient went into main_grad (the same fp32 sum as unfused), none of it to .grad
            assert _rel(p.main_grad - m0, q.grad) < 1e-6


@pytest.mark.gpu
def test_no_fusion_while_a_cuda_graph_is_captured():
    """A graph replay runs no Python: nothing would flag the weight, so DDP would add the
    placeholder. Under capture the real gradient is returned and main_grad is left to DDP."""
    import dmoe_kernels as dk
    from megatron_dmoe.moe.experts.sparse import _weight_grad

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(15)
    counts = torch.tensor([9, 0, 30, 5])
    topology = dk.Topology.for_experts(counts.to(device), int(counts.sum()), FFN, BS)
    data = torch.randn(topology.data_shape(), generator=g).to(device)
    b = torch.randn(topology.shape[0], HIDDEN, generator=g).to(device)
    weight = torch.randn(E, FFN, HIDDEN, generator=g).to(device)
    expected = _weight_grad(data, topology, b, _leaf_params([weight])[0])  # unfused; compiles the kernels
    w1 = _leaf_params([weight], torch.float32, seed=9)[0]
    w1.main_grad = w1.main_grad.to(device)
    w1.grad_added_to_main_grad = True
    m0 = w1.main_grad.clone()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grad = _weight_grad(data, topology, b, w1)
    graph.replay()
    torch.cuda.synchronize()
    assert w1.grad_added_to_main_grad is False
    assert torch.equal(w1.main_grad, m0)
    assert _rel(grad, expected) < 1e-5


@pytest.mark.slow
def test_combine_with_a_frozen_down_projection_gives_the_other_gradients_unchanged():
    """Without w2's gradient the backward takes its other branch for the rows' router weights."""
    tokens, state, weights = _problem(40, "gelu", torch.float32, kind="combine")
    out_grad = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(41))
    grads = []
    for train_w2 in (True, False):
        w1, w2 = weights[0].clone().requires_grad_(), weights[2].clone().requires_grad_(train_w2)
        x = tokens.clone().requires_grad_()
        router_weights = state.weights.clone().requires_grad_()
        y = sparse_experts_combine(x, w1, None, w2, router_weights, state.topology, state.positions, state.counts,
                                   "gelu")
        y.backward(out_grad)
        assert (w2.grad is not None) == train_w2
        grads.append((x.grad, router_weights.grad, w1.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["flag", "main_grad_only"])
@pytest.mark.parametrize("kind, activation, dtype", [("combine", "gelu", torch.float16),
                                                     ("expert_mlp", "swiglu", torch.float32)],
                         ids=["combine-gelu-fp16", "expert_mlp-swiglu-fp32"])
@pytest.mark.slow
def test_first_gradient_after_zeroing_is_stored_then_added(kind, activation, dtype, mode):
    """After WgradStash.main_grads_zeroed() a weight's first gradient overwrites main_grad (here
    filled with NaN, so a read would show) and the next one is added; without that call both add."""
    from megatron_dmoe.moe.experts.per_step_wgrad import WgradStash

    x, state, weights = _problem(15, activation, dtype, kind=kind)
    rows = T if kind == "combine" else x.shape[0]
    grads = [torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    plain = [_leaf_params(weights) for _ in grads]
    for p, g in zip(plain, grads):
        _backward(kind, x, state, p, activation, g)
    tol = 1e-6 if dtype == torch.float32 else 2e-3

    stash = WgradStash()
    params = _leaf_params(weights, torch.float32, seed=9, main_grad_only=mode == "main_grad_only")
    for p in params:
        if p is not None:
            p.main_grad.fill_(float("nan"))
    stash.main_grads_zeroed()
    _backward(kind, x, state, params, activation, grads[0], wgrad_stash=stash)
    for p, q in zip(params, plain[0]):
        if p is not None:
            assert _rel(p.main_grad, q.grad) < tol
    _backward(kind, x, state, params, activation, grads[1], wgrad_stash=stash)
    for p, q0, q1 in zip(params, plain[0], plain[1]):
        if p is not None:
            assert _rel(p.main_grad, q0.grad.double() + q1.grad.double()) < tol

    fresh = _leaf_params(weights, torch.float32, seed=9, main_grad_only=mode == "main_grad_only")
    old = [None if p is None else p.main_grad.clone() for p in fresh]
    _backward(kind, x, state, fresh, activation, grads[0], wgrad_stash=WgradStash())  # never told: adds
    for p, q, m0 in zip(fresh, plain[0], old):
        if p is not None:
            assert _rel(p.main_grad - m0, q.grad) < tol


def test_first_write_counts_each_weight_once_per_zeroing():
    from megatron_dmoe.moe.experts.per_step_wgrad import WgradStash

    stash, a, b = WgradStash(), torch.zeros(2), torch.zeros(2)
    assert not stash.first_write(a)  # no zeroing announced
    stash.main_grads_zeroed()
    assert [stash.first_write(w) for w in (a, b, a, b)] == [True, True, False, False]
    stash.main_grads_zeroed()
    assert stash.first_write(b) and not stash.first_write(b)
