"""Shared experts, group-limited routing and the sequence-wise aux loss against the float64
per-token reference (tests/moe/moe_reference.py): output and every gradient."""
import pytest
import torch

from megatron_dmoe.moe import MoEOptions
from megatron_dmoe.moe.router import group_limited_topk
from megatron_dmoe.parallel.param_roles import is_expert_parallel
from moe_reference import choose_in_groups, draw_inputs, draw_shared, rel_err, run_layer, run_reference

HIDDEN, FFN, SHARED_FFN = 12, 20, 16
AUX, ZLOSS = 0.05, 0.01

# case: (router settings as in test_layer_vs_reference, layer options, reference options, shared gate).
# Grouped cases have top_k // group_topk >= 2: with 1, a group's score is its best expert's and the
# best groups always hold the overall top-k, so the restriction would change nothing.
CASES = {
    "groups-2of3-top4": (
        dict(s=7, b=2, E=12, k=4, score="softmax", pre=True, renorm=False, scale=1.0, dead=[]),
        dict(router_num_groups=3, router_group_topk=2), dict(groups=(3, 2)), None),
    "groups-post-softmax-top4": (
        dict(s=5, b=3, E=8, k=4, score="softmax", pre=False, renorm=False, scale=1.0, dead=[]),
        dict(router_num_groups=4, router_group_topk=2), dict(groups=(4, 2)), None),
    # DeepSeek-V2: a group scored by its best expert; top_k need not be a multiple of group_topk
    "groups-max-top3": (
        dict(s=8, b=2, E=12, k=3, score="softmax", pre=True, renorm=True, scale=1.0, dead=[]),
        dict(router_num_groups=4, router_group_topk=2, router_group_score="max"), dict(groups=(4, 2, "max")),
        None),
    "groups-max-top4": (  # top_k // group_topk = 2: the sum of the best 2 would choose other groups
        dict(s=8, b=2, E=12, k=4, score="softmax", pre=True, renorm=False, scale=1.0, dead=[]),
        dict(router_num_groups=4, router_group_topk=2, router_group_score="max"), dict(groups=(4, 2, "max")),
        None),
    "groups-sigmoid-one-group": (
        dict(s=6, b=2, E=6, k=2, score="sigmoid", pre=True, renorm=True, scale=2.5, dead=[]),
        dict(router_num_groups=3, router_group_topk=1), dict(groups=(3, 1)), None),
    "shared": (
        dict(s=5, b=2, E=4, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[3]),
        {}, {}, False),
    "shared-gate": (
        dict(s=5, b=2, E=4, k=1, score="softmax", pre=True, renorm=False, scale=1.0, dead=[]),
        {}, {}, True),
    "sequence-aux": (
        dict(s=6, b=3, E=5, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[1]),
        dict(aux_loss_type="sequence"), dict(aux_type="sequence", num_sequences=3), None),
    "sequence-aux-sigmoid": (
        dict(s=4, b=4, E=6, k=3, score="sigmoid", pre=True, renorm=True, scale=1.0, dead=[]),
        dict(aux_loss_type="sequence"), dict(aux_type="sequence", num_sequences=4), None),
    # one micro-batch in one process: the global loss is the micro-batch loss
    "global-aux-one-micro-batch": (
        dict(s=5, b=2, E=6, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[2]),
        dict(aux_loss_type="global"), {}, None),
    "everything": (
        dict(s=4, b=3, E=8, k=4, score="sigmoid", pre=True, renorm=True, scale=2.0, dead=[]),
        dict(router_num_groups=4, router_group_topk=2, aux_loss_type="sequence"),
        dict(groups=(4, 2), aux_type="sequence", num_sequences=3), True),
}


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_option_matches_per_token_reference(name, activation):
    case, layer_options, ref_options, gate = CASES[name]
    seed = sorted(CASES).index(name) * 2 + ["gelu", "swiglu"].index(activation)
    weights = draw_inputs(case, seed, torch.float64, HIDDEN, FFN)
    shared = None if gate is None else draw_shared(seed, HIDDEN, SHARED_FFN, gate)
    out_grad = torch.randn(weights[0].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out, grads, load = run_layer(case, activation, "reference", False, weights, out_grad, torch.float64,
                                 aux=AUX, z=ZLOSS, shared=shared, **layer_options)
    ref_out, ref_grads, chosen = run_reference(case, activation, weights, out_grad, aux=AUX, z=ZLOSS,
                                               shared=shared, **ref_options)
    assert [sum(e in c for c in chosen) for e in range(case["E"])] == load
    assert rel_err(out, ref_out) < 1e-10
    assert set(grads) == {k for k, v in ref_grads.items() if v is not None} | {"v1"}
    for key, ref in ref_grads.items():
        if ref is not None:
            assert rel_err(grads[key], ref) < 1e-10, key


def test_grouped_routing_keeps_tokens_inside_their_groups_and_changes_choices():
    """The cases above only mean something if the groups change some token's experts."""
    g = torch.Generator().manual_seed(3)
    scores = torch.softmax(torch.randn(64, 8, generator=g, dtype=torch.float64), dim=-1)
    values, indices = group_limited_topk(scores, 2, 4, 1)
    assert all(len(set((row // 2).tolist())) == 1 for row in indices)  # one group of 2 experts per token
    assert torch.equal(values, scores.gather(1, indices))
    plain = torch.topk(scores, 2, dim=-1).indices
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(indices, plain))
    for row, picked in zip(scores, indices):
        assert set(picked.tolist()) == set(choose_in_groups(row, 2, 4, 1))


@pytest.mark.parametrize("values, field, words", [
    (dict(router_num_groups=3, router_group_topk=1), "router_num_groups", "does not divide"),
    (dict(router_num_groups=4, router_group_topk=5), "router_group_topk", "larger than"),
    (dict(router_num_groups=4, router_group_topk=None), "router_group_topk", "needs both"),
    (dict(router_num_groups=4, router_group_topk=3, top_k=2), "router_group_topk", "does not divide"),
    (dict(router_num_groups=4, router_group_topk=1, top_k=4), "router_group_topk", "cannot hold"),
    (dict(router_num_groups=4, router_group_topk=1, top_k=3, router_group_score="max"), "router_group_topk",
     "cannot hold"),
    (dict(router_num_groups=4, router_group_topk=2, router_group_score="best"), "router_group_score",
     "sum, max"),
    (dict(shared_expert_gate=True), "shared_expert_gate", "without a shared expert"),
    (dict(aux_loss_type="batch"), "aux_loss_type", "micro_batch, sequence, global"),
    (dict(shared_expert_ffn_hidden_size=-1), "shared_expert_ffn_hidden_size", "out of range"),
])
def test_bad_options_are_refused_with_the_field_named(values, field, words):
    base = dict(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=f"'{field}'.*{words}"):
        MoEOptions(**{**base, **values})


def test_megatron_config_fields_map_to_the_options():
    from megatron_dmoe.moe import MoELayer
    from moe_reference import make_config

    config = make_config(8, 8, 8, 2, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                         moe_router_num_groups=4, moe_router_group_topk=2,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)
    opts = MoEOptions.from_transformer_config(config)
    assert (opts.shared_expert_ffn_hidden_size, opts.shared_expert_gate) == (16, True)
    assert (opts.router_num_groups, opts.router_group_topk, opts.aux_loss_type) == (4, 2, "sequence")
    layer = MoELayer(config)
    assert layer.shared_experts.w1.shape == (16, 8) and layer.shared_experts.gate_weight.shape == (1, 8)
    # ordinary (data-parallel) parameters, unlike the experts'
    assert not any(is_expert_parallel(p) for p in layer.shared_experts.parameters())
    assert is_expert_parallel(layer.experts.w1)


def test_options_off_add_no_modules():
    from megatron_dmoe.moe import MoELayer
    from moe_reference import make_config

    layer = MoELayer(make_config(8, 8, 4, 2))
    assert layer.shared_experts is None and layer.router.groups is None and layer.router.global_load is None


def test_group_max_score_is_accepted_where_sum_needs_a_divisor():
    MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=3, router_num_groups=4, router_group_topk=2,
               router_group_score="max")
    with pytest.raises(ValueError, match="does not divide"):
        MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=3, router_num_groups=4,
                   router_group_topk=2)


def test_sequence_loss_leaves_padding_out():
    """With padding, each sequence's loss counts its real tokens only (an all-padding sequence adds 0)."""
    from megatron_dmoe.moe import load_balancing_loss
    from megatron_dmoe.moe.aux_loss import sequence_load_balancing_loss
    from megatron_dmoe.moe.router import count_assignments, route

    g = torch.Generator().manual_seed(11)
    s, b, E, k = 6, 3, 5, 2
    logits = torch.randn(s * b, E, generator=g, dtype=torch.float64)
    indices, _, scores = route(logits, k)
    padding = torch.rand(b, s, generator=g) < 0.4
    padding[2] = True  # the third sequence is all padding
    valid = (~padding).transpose(0, 1).reshape(-1)
    loss = sequence_load_balancing_loss(scores, indices, b, k, 0.1, valid=valid)
    expected = 0.0
    for seq in range(2):
        rows = torch.arange(seq, s * b, b)[valid[seq::b]]
        expected += load_balancing_loss(scores[rows], count_assignments(indices[rows], E), k, 0.1)
    assert torch.allclose(loss, torch.as_tensor(expected / b), rtol=1e-12)


def test_a_layer_with_side_streams_deep_copies():
    """CUDA streams cannot be copied: a copy of a shared expert that made its side stream (stood in
    for here by a lock, which cannot be copied either) starts without one, the original keeps it."""
    import copy
    import threading

    from megatron_dmoe.moe.shared_experts import SharedExpertMLP

    shared = SharedExpertMLP(MoEOptions(hidden_size=8, ffn_hidden_size=16, num_experts=4,
                                        shared_expert_ffn_hidden_size=16))
    lock = threading.Lock()
    shared._side_streams["cuda:0"] = lock
    twin = copy.deepcopy(shared)
    assert twin._side_streams == {} and shared._side_streams == {"cuda:0": lock}
    torch.testing.assert_close(twin.w1, shared.w1)
    x = torch.randn(5, 8)
    torch.testing.assert_close(twin(x), shared(x))
