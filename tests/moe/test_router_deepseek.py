"""Our router against transformers' DeepSeek-V2 and DeepSeek-V3 routers on the same logits: the
settings dmoe-import gives each (hf_import/deepseek_config.py) choose the same experts with the
same weights, group-limited or not."""
import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from megatron_dmoe.moe import route

HIDDEN, EXPERTS = 16, 16


def _sorted(indices, weights):
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order)


def _same(ours, theirs):
    (oi, ow), (ti, tw) = _sorted(*ours), _sorted(*theirs)
    assert torch.equal(oi, ti)
    torch.testing.assert_close(ow, tw, rtol=1e-6, atol=0)


@pytest.mark.parametrize("method, groups, topk_group, top_k", [
    ("greedy", None, None, 3),
    ("group_limited_greedy", 4, 2, 3),  # a group's best expert scores it; 3 picks from 2 groups of 4
    ("group_limited_greedy", 2, 1, 2),
])
def test_deepseek_v2_routes_as_transformers(method, groups, topk_group, top_k):
    config = transformers.DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=4, n_routed_experts=EXPERTS,
                                           num_experts_per_tok=top_k,
                                           topk_method=method, n_group=groups, topk_group=topk_group,
                                           routed_scaling_factor=1.5)
    torch.manual_seed(0)
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.2)  # flat enough that a group's best two can outweigh its best
    x = torch.randn(256, HIDDEN)
    logits, weights, indices = router(x)
    grouped = (groups, topk_group, "max") if method == "group_limited_greedy" else None
    ours, our_weights, _ = route(logits, top_k, "softmax", pre_softmax=True, renormalize=False,
                                 topk_scaling_factor=1.5, groups=grouped)
    _same((ours, our_weights), (indices, weights))


@pytest.mark.parametrize("groups, topk_group, top_k, renormalize", [
    (4, 2, 4, True),  # a group's best two summed; 4 picks from 2 groups of 4
    (8, 4, 8, False),
    (1, 1, 3, True),  # one group: no limit
])
def test_deepseek_v3_routes_as_transformers(groups, topk_group, top_k, renormalize):
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=top_k,
                                           n_group=groups, topk_group=topk_group, norm_topk_prob=renormalize,
                                           routed_scaling_factor=2.5)
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.uniform_(-0.5, 0.5)  # large enough to change choices
    x = torch.randn(64, HIDDEN)
    logits, weights, indices = router(x)
    grouped = (groups, topk_group, "sum") if groups > 1 else None
    ours, our_weights, _ = route(logits, top_k, "sigmoid", renormalize=renormalize, topk_scaling_factor=2.5,
                                 expert_bias=router.e_score_correction_bias, groups=grouped)
    _same((ours, our_weights), (indices, weights))
    unbiased, _, _ = route(logits, top_k, "sigmoid", renormalize=renormalize, topk_scaling_factor=2.5, groups=grouped)
    assert not torch.equal(_sorted(unbiased, unbiased)[0], _sorted(indices, indices)[0])  # the bias matters here
