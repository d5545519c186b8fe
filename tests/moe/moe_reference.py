"""Ground truth for the MoE layer tests: a float64 per-token loop, written without the layer's code.

For each token: score every expert, choose its k experts by a python sort, run each chosen
expert's MLP on that token alone and add the outputs with their weights. Aux losses are
computed from the same per-token choices. Everything is plain differentiable torch, so
autograd on this function gives the reference gradients.
"""
import math

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def gelu(z):
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def silu(z):
    return z / (1.0 + torch.exp(-z))


def sigmoid(z):
    return 1.0 / (1.0 + torch.exp(-z))


def softmax(v):
    e = torch.exp(v - v.max())
    return e / e.sum()


def choose(scores, k):
    """Indices of the k largest entries of a 1-D tensor, largest first (python sort)."""
    values = [float(s) for s in scores.detach()]
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


def choose_in_groups(scores, k, num_groups, group_topk, how="sum"):
    """Group-limited choice: groups of consecutive experts scored by the sum of their best
    k // group_topk entries (how="sum") or their best entry ("max"), the best group_topk groups
    kept, then the k best experts in them."""
    values = [float(s) for s in scores.detach()]
    size = len(values) // num_groups
    best = 1 if how == "max" else k // group_topk
    group_score = [sum(sorted(values[g * size:(g + 1) * size], reverse=True)[:best]) for g in range(num_groups)]
    kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
    allowed = [e for e in range(len(values)) if e // size in kept]
    return sorted(allowed, key=lambda i: -values[i])[:k]


def shared_mlp(x_t, shared, activation):
    """The shared expert on one token: shared = dict(w1, v1, w2 [f, h], gate [1, h] or None)."""
    h1 = shared["w1"] @ x_t
    a = gelu(h1) if activation == "gelu" else silu(h1) * (shared["v1"] @ x_t)
    y = shared["w2"].t() @ a
    if shared.get("gate") is not None:
        y = y * sigmoid(shared["gate"][0] @ x_t)
    return y


def reference_moe(
    x, router_w, w1, v1, w2, *, top_k, score_function="softmax", pre_softmax=True, renormalize=False,
    scaling=1.0, activation="gelu", aux_coeff=0.0, z_coeff=0.0, expert_bias=None, groups=None,
    shared=None, aux_type="micro_batch", num_sequences=1,
):
    """x [T, h]; router_w [E, h]; w1, v1, w2 [E, f, h]. Returns (y [T, h], aux loss, chosen lists).

    groups: (num_groups, group_topk[, "sum" | "max"]) for group-limited routing; shared: the shared expert's
    weights (see shared_mlp); aux_type sequence: tokens t belong to sequence t % num_sequences
    (the layer's [s, b] order) and the loss is the mean of every sequence's own; global on one
    micro-batch is micro_batch."""
    T, _ = x.shape
    E = router_w.shape[0]
    logits = x @ router_w.t()
    outputs, chosen, aux_probs = [], [], []

    def pick(selection):
        return choose(selection, top_k) if groups is None else choose_in_groups(selection, top_k, *groups)

    for t in range(T):
        row = logits[t]
        if score_function == "softmax":
            p = softmax(row)
            aux_probs.append(p)
            if pre_softmax:
                picked = pick(p)
                w = p[picked]
            else:
                picked = pick(row)
                w = softmax(row[picked])
        else:
            s = sigmoid(row)
            aux_probs.append(s / s.sum())
            selection = s if expert_bias is None else s + expert_bias
            picked = pick(selection)
            w = s[picked]
        if renormalize:
            w = w / w.sum()
        w = w * scaling
        y = torch.zeros_like(x[t])
        for j, e in enumerate(picked):
            h1 = w1[e] @ x[t]
            a = gelu(h1) if activation == "gelu" else silu(h1) * (v1[e] @ x[t])
            y = y + w[j] * (w2[e].t() @ a)
        if shared is not None:
            y = y + shared_mlp(x[t], shared, activation)
        outputs.append(y)
        chosen.append(picked)
    aux = torch.zeros((), dtype=x.dtype)
    if aux_coeff:
        sequences = [list(range(T))]
        if aux_type == "sequence":
            sequences = [list(range(b, T, num_sequences)) for b in range(num_sequences)]
        for tokens in sequences:
            n = len(tokens)
            counts = [sum(e in chosen[t] for t in tokens) for e in range(E)]
            mean_prob = torch.stack([aux_probs[t] for t in tokens]).mean(0)
            aux = aux + aux_coeff * E * sum(counts[e] / (n * top_k) * mean_prob[e] for e in range(E)) / len(sequences)
    if z_coeff:
        lse = torch.stack([row.max() + torch.log(torch.exp(row - row.max()).sum()) for row in logits])
        aux = aux + z_coeff * (lse**2).mean()
    return torch.stack(outputs), aux, chosen


def make_config(hidden, ffn, experts, top_k, *, activation="gelu", score_function="softmax",
                pre_softmax=True, dtype=torch.float64, **extra):
    import torch.nn.functional as F

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        num_moe_experts=experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=ffn,
        moe_router_score_function=score_function,
        moe_router_pre_softmax=pre_softmax,
        gated_linear_unit=activation == "swiglu",
        activation_func=F.silu if activation == "swiglu" else F.gelu,
        params_dtype=dtype,
        use_cpu_initialization=True,
        **extra,
    )


def load_weights(layer, router_w, w1, v1, w2):
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        layer.experts.w1.copy_(w1)
        layer.experts.w2.copy_(w2)
        if layer.experts.v1 is not None:
            layer.experts.v1.copy_(v1)


def draw_inputs(case, seed, dtype, hidden, ffn):
    """Random (x [T, h], router_w, w1, v1, w2) in float64, rounded to `dtype`.

    case: dict with s, b (tokens = s*b), E, k, score, pre and dead (experts that must get no
    token). The dead experts get a large negative router weight on a feature every token has. A
    draw where some token's k-th and (k+1)-th scores nearly tie is redrawn, so that a
    lower-precision run chooses the same experts as the float64 reference.
    """
    T, E, k = case["s"] * case["b"], case["E"], case["k"]
    for attempt in range(50):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        x = torch.randn(T, hidden, generator=g, dtype=torch.float64)
        # logits of order 2 at any width
        router_w = (2.0 / hidden**0.5) * torch.randn(E, hidden, generator=g, dtype=torch.float64)
        x[:, 0] = x[:, 0].abs() + 1.0
        router_w[case["dead"], 0] = -40.0
        w1, v1, w2 = (0.3 * torch.randn(E, ffn, hidden, generator=g, dtype=torch.float64) for _ in range(3))
        tensors = [t.to(dtype).to(torch.float64) for t in (x, router_w, w1, v1, w2)]
        if k == E or _min_selection_gap(tensors[0] @ tensors[1].t(), case) > 1e-5:
            return tensors
    raise AssertionError("could not draw a routing without near-ties")


def _min_selection_gap(logits, case):
    """Smallest gap, over tokens, between the k-th and (k+1)-th choice, where rounding acts:
    on the logits for softmax (same order as the probabilities), on the scores for sigmoid
    (which saturate)."""
    scores = torch.sigmoid(logits) if case["score"] == "sigmoid" else logits
    top = scores.sort(dim=-1, descending=True).values
    return float((top[:, case["k"] - 1] - top[:, case["k"]]).min())


def draw_shared(seed, hidden, ffn, gate, dtype=torch.float64):
    """Shared-expert weights (see shared_mlp) in float64, rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed + 777)
    w1, v1, w2 = ((0.3 * torch.randn(ffn, hidden, generator=g, dtype=torch.float64)).to(dtype).double()
                  for _ in range(3))
    g_w = (0.5 * torch.randn(1, hidden, generator=g, dtype=torch.float64)).to(dtype).double() if gate else None
    return dict(w1=w1, v1=v1, w2=w2, gate=g_w)


def load_shared(module, shared):
    with torch.no_grad():
        module.w1.copy_(shared["w1"])
        module.w2.copy_(shared["w2"])
        if module.v1 is not None:
            module.v1.copy_(shared["v1"])
        if module.gate_weight is not None:
            module.gate_weight.copy_(shared["gate"])


SHARED_KEYS = ("w1", "v1", "w2", "gate")


def run_layer(case, activation, backend, memory_optimized, weights, out_grad, dtype, aux=0.0, z=0.0,
              device="cpu", shared=None, padding=None, **layer_kwargs):
    """Build an MoELayer with `weights` (and the shared expert's, `shared`), run forward and
    backward in `dtype` on `device`; padding [b, s] bool or None.

    Returns (output [T, h], grads dict of x/router/w1/v1/w2 (and shared_w1, ...), per-expert load
    the layer recorded)."""
    from megatron_dmoe.moe import MoELayer

    x, router_w, w1, v1, w2 = weights
    hidden, ffn = x.shape[1], w1.shape[1]
    config = make_config(
        hidden, ffn, case["E"], case["k"], activation=activation, score_function=case["score"],
        pre_softmax=case["pre"], dtype=dtype, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z,
        moe_router_topk_scaling_factor=case["scale"],
    )
    if shared is not None:
        layer_kwargs.update(shared_expert_ffn_hidden_size=shared["w1"].shape[0],
                            shared_expert_gate=shared["gate"] is not None)
    layer = MoELayer(config, backend=backend, memory_optimized=memory_optimized, renormalize=case["renorm"],
                     **layer_kwargs)
    layer.set_layer_number(7)
    load_weights(layer, router_w, w1, v1, w2)
    if shared is not None:
        load_shared(layer.shared_experts, shared)
    layer.to(device).train()
    x_in = x.to(device=device, dtype=dtype).view(case["s"], case["b"], hidden).requires_grad_()
    out, bias = layer(x_in, padding_mask=padding)
    assert bias is None and out.shape == x_in.shape and out.dtype == dtype
    (out * out_grad.to(device=device, dtype=dtype).view_as(out)).sum().backward()
    load = layer.run_state.metrics.snapshot()["layers"][7]["load"]
    grads = dict(
        x=x_in.grad.reshape(-1, hidden), router=layer.router.weight.grad, w1=layer.experts.w1.grad,
        w2=layer.experts.w2.grad, v1=None if layer.experts.v1 is None else layer.experts.v1.grad,
    )
    if shared is not None:
        module = layer.shared_experts
        params = dict(w1=module.w1, v1=module.v1, w2=module.w2, gate=module.gate_weight)
        grads.update({f"shared_{k}": p.grad for k, p in params.items() if p is not None})
    return out.reshape(-1, hidden), grads, load


def run_reference(case, activation, weights, out_grad, aux=0.0, z=0.0, shared=None, **options):
    """reference_moe on `weights` (and `shared`), backward of sum(y * out_grad) + aux losses;
    `options` are reference_moe's (groups, aux_type, num_sequences)."""
    leaves = [t.clone().requires_grad_() for t in weights]
    shared_leaves = None
    if shared is not None:
        shared_leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in shared.items()}
    y, aux_loss, chosen = reference_moe(
        *leaves, top_k=case["k"], score_function=case["score"], pre_softmax=case["pre"],
        renormalize=case["renorm"], scaling=case["scale"], activation=activation, aux_coeff=aux, z_coeff=z,
        shared=shared_leaves, **options,
    )
    ((y * out_grad).sum() + aux_loss).backward()
    grads = dict(zip(("x", "router", "w1", "v1", "w2"), (t.grad for t in leaves)))
    if shared_leaves is not None:
        grads.update({f"shared_{k}": v.grad for k, v in shared_leaves.items() if v is not None})
    return y, grads, chosen


def rel_err(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))
