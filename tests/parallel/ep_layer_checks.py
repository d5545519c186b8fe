"""Checks that run inside every process of a process group (see process_group.run_in_processes).

Each rank draws its own tokens (a different number per rank), all ranks draw the same GLOBAL
weights, and the expert-parallel layer is compared with the single-process layer (EP = 1, every
expert local, tested against the float64 per-token loop in tests/moe) on this rank's tokens:
output, input gradient and router gradient equal it; expert-weight gradients, gathered back to
the global [E, f, h] tensors, equal the sum over the expert-parallel group of the single-process
gradients (the all-to-all's backward brings every token's contribution to the owning rank).
The defaults are the CPU (gloo) setting; the device, sizes and tolerances are parameters, and a
case may name its backend, dtype and expert exchange (nccl or symmetric; default auto).
"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dmoe.moe import AuxLossScaler, MoELayer, MoERunState
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.parallel.expert_layout import ExpertLayout
from moe_reference import draw_shared, load_shared, make_config, rel_err

HIDDEN, FFN = 8, 12  # FFN divisible by 4: experts split over up to 4 ranks
# relative error allowed per dtype: the two layers differ only in summation order
TOLERANCES = {torch.float64: 1e-12, torch.float32: 2e-5}

# name: settings (ep: expert-parallel size; E experts, top_k; dead: experts no token may choose).
# All run in 4 processes: EP = 2 cases form two independent expert-parallel groups.
LAYER_CASES = {
    "ep2-E4-top2-rank1-idle": dict(ep=2, E=4, k=2, dead=[2, 3], aux=0.05, z=0.01),
    "ep2-E4-top1-swiglu": dict(ep=2, E=4, k=1, activation="swiglu", dead=[1]),
    "ep2-E2-top2-post-softmax": dict(ep=2, E=2, k=2, pre=False),
    "ep2-E1-split2-sigmoid": dict(ep=2, E=1, k=1, score="sigmoid", aux=0.05),
    "ep2-E4-top2-padding": dict(ep=2, E=4, k=2, padding=True, aux=0.05, z=0.01),
    "ep2-E4-grouped-fp32-memopt-rank1-idle": dict(ep=2, E=4, k=2, backend="grouped", dtype=torch.float32,
                                                  memory_optimized=True, activation="swiglu", dead=[2, 3]),
    "ep4-E8-top2-rank3-idle": dict(ep=4, E=8, k=2, dead=[6, 7], aux=0.05, z=0.01),
    "ep4-E4-top3-sigmoid-swiglu": dict(ep=4, E=4, k=3, score="sigmoid", renorm=True, activation="swiglu",
                                       dead=[0]),
    "ep4-E2-split2-top1-dead": dict(ep=4, E=2, k=1, dead=[1], aux=0.05),
    "ep4-E2-split2-top2-swiglu": dict(ep=4, E=2, k=2, activation="swiglu"),
    "ep4-E1-split4-sigmoid": dict(ep=4, E=1, k=1, score="sigmoid"),
    # newer MoE options (layer keyword arguments in "options"; shared: the shared expert's gate)
    "ep2-E8-groups-shared-gate-seq-aux": dict(ep=2, E=8, k=4, aux=0.05, shared=True, options=dict(
        router_num_groups=4, router_group_topk=2, aux_loss_type="sequence")),
    "ep2-E4-global-aux-padding": dict(ep=2, E=4, k=2, padding=True, aux=0.05, z=0.01,
                                      options=dict(aux_loss_type="global")),
    "ep4-E8-groups-sigmoid-global-aux": dict(ep=4, E=8, k=2, score="sigmoid", renorm=True, aux=0.05, options=dict(
        router_num_groups=4, router_group_topk=1, aux_loss_type="global")),
    "ep4-E2-split2-shared-swiglu": dict(ep=4, E=2, k=1, activation="swiglu", shared=False, dead=[1]),
}
SHARED_FFN = 8


def _draw_weights(case, seed, dtype, hidden, ffn):
    g = torch.Generator().manual_seed(seed)
    E = case["E"]
    router_w = (2.0 / hidden**0.5) * torch.randn(E, hidden, generator=g, dtype=torch.float64)
    router_w[case.get("dead", []), 0] = -40.0  # every token has a large positive feature 0
    w1, v1, w2 = (0.3 * torch.randn(E, ffn, hidden, generator=g, dtype=torch.float64) for _ in range(3))
    return [t.to(dtype) for t in (router_w, w1, v1, w2)]


def _draw_tokens(seed, rank, dtype, hidden, device):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    s, b = 3 + 2 * rank, 2  # a different number of tokens on every rank
    x = torch.randn(s, b, hidden, generator=g, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 1.0
    out_grad = torch.randn(s, b, hidden, generator=g, dtype=torch.float64)
    padding = torch.rand(b, s, generator=g) < 0.3
    return x.to(device, dtype), out_grad.to(device, dtype), padding.to(device)


def _build(case, ep, dtype, weights, layer_number, hidden, ffn, device, run_state=None):
    config = make_config(
        hidden, ffn, case["E"], case["k"], activation=case.get("activation", "gelu"),
        score_function=case.get("score", "softmax"), pre_softmax=case.get("pre", True), dtype=dtype,
        moe_aux_loss_coeff=case.get("aux", 0.0), moe_z_loss_coeff=case.get("z", 0.0),
        expert_model_parallel_size=ep,
    )
    options = dict(case.get("options", {}))
    if "shared" in case:
        options.update(shared_expert_ffn_hidden_size=SHARED_FFN, shared_expert_gate=case["shared"])
    layer = MoELayer(config, backend=case.get("backend", "reference"), renormalize=case.get("renorm", None),
                     memory_optimized=case.get("memory_optimized", False), layer_number=layer_number,
                     ep_exchange=case.get("exchange", "auto"), run_state=run_state, **options)
    router_w, w1, v1, w2 = weights
    if "shared" in case:
        load_shared(layer.shared_experts, draw_shared(len(case), hidden, SHARED_FFN, case["shared"], dtype))
    layout = layer.experts.layout
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        layer.experts.w1.copy_(layout.local_slice(w1))
        layer.experts.w2.copy_(layout.local_slice(w2))
        if layer.experts.v1 is not None:
            layer.experts.v1.copy_(layout.local_slice(v1))
    return layer.to(device).train()


def _run(layer, x, out_grad, padding):
    x = x.clone().requires_grad_()
    out, _ = layer(x, padding_mask=padding)
    (out * out_grad).sum().backward()
    return out.detach(), x.grad


def _gather_global(local, layout: ExpertLayout, group):
    parts = [torch.empty_like(local) for _ in range(layout.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return layout.assemble(parts)


def check_layer_cases(cases=LAYER_CASES, device="cpu", hidden=HIDDEN, ffn=FFN, tolerances=TOLERANCES) -> None:
    """Every case in `cases` (settings as in LAYER_CASES; each may name "backend" and "dtype"), on
    `device`, with `hidden`/`ffn` sizes; `tolerances` maps dtypes to the relative error allowed."""
    AuxLossScaler.set_loss_scale(1.0)
    for seed, (name, case) in enumerate(sorted(cases.items())):
        if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() != case["ep"]:
            # new groups only when EP changes (names start with it): each NCCL group holds buffers
            init_distributed(device, expert_model_parallel_size=case["ep"])
        dtype = case.get("dtype", torch.float64)
        tol = tolerances[dtype]
        rank = dist.get_rank()
        weights = _draw_weights(case, seed, dtype, hidden, ffn)
        x, out_grad, padding = _draw_tokens(seed, rank, dtype, hidden, device)
        padding = padding if case.get("padding") else None

        state = MoERunState()  # both layers record into one, as a model's layers do
        ep_layer = _build(case, case["ep"], dtype, weights, 1, hidden, ffn, device, state)
        assert ep_layer.experts.w1.shape == ep_layer.experts.layout.local_shape(hidden), name
        out, dx = _run(ep_layer, x, out_grad, padding)
        single = _build(case, 1, dtype, weights, 2, hidden, ffn, device, state)
        ref_out, ref_dx = _run(single, x, out_grad, padding)

        assert rel_err(out, ref_out) < tol, (name, rank, "output")
        assert rel_err(dx, ref_dx) < tol, (name, rank, "input grad")
        assert rel_err(ep_layer.router.weight.grad, single.router.weight.grad) < tol, (name, rank, "router grad")
        if ep_layer.shared_experts is not None:  # replicated, data-parallel: the same tokens' gradient
            for (key, p), q in zip(ep_layer.shared_experts.named_parameters(), single.shared_experts.parameters()):
                assert p.grad.abs().max() > 0 and rel_err(p.grad, q.grad) < tol, (name, rank, "shared", key)

        group = ps.get_expert_model_parallel_group()
        layout = ep_layer.experts.layout
        for key in ("w1", "v1", "w2"):
            local = getattr(ep_layer.experts, key)
            if local is None:
                continue
            gathered = _gather_global(local.grad, layout, group)
            expected = getattr(single.experts, key).grad.clone()
            dist.all_reduce(expected, group=group)  # every token of the EP group reaches the owner
            assert expected.abs().max() > 0, (name, key)
            assert rel_err(gathered, expected) < tol, (name, rank, key)
            # dead experts: no token, no gradient (and the case really has such experts)
            for e in case.get("dead", []):
                assert gathered[e].abs().max() == 0, (name, key, e)

        # loads recorded by both layers reduce to the same global counts over all ranks
        snapshot = state.metrics.snapshot(group=ps.get_data_parallel_group())
        assert snapshot["layers"][1]["load"] == snapshot["layers"][2]["load"], name
        for e in case.get("dead", []):
            assert snapshot["layers"][1]["load"][e] == 0, name
