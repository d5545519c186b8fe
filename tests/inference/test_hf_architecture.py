"""Which architecture each shipped model exports as, and what a refusal names."""
import pytest

from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.export.hf_architecture import (
    DMOE_GPT,
    GPT2,
    LLAMA,
    MIXTRAL,
    QWEN2_MOE,
    QWEN3,
    hf_architecture,
    why_not_stock,
)
from megatron_dmoe.inference.errors import UsageError


@pytest.mark.parametrize("name, architecture", [
    ("zoo/mixtral_xs", MIXTRAL), ("zoo/dense_xs", GPT2), ("zoo/dense_small", GPT2),
    # no stock architecture: our own, with its modeling file
    ("tiny", DMOE_GPT), ("zoo/dmoe_xs", DMOE_GPT), ("zoo/dmoe_small", DMOE_GPT),
    ("zoo/finegrained_swiglu", DMOE_GPT), ("zoo/deepseek_finegrained", DMOE_GPT),
])
def test_shipped_models_export(name, architecture):
    assert hf_architecture(resolve(load_config(name))) == architecture


LLAMA_LIKE = ["moe.num_experts=0", "model.activation=swiglu", "model.normalization=RMSNorm",
              "model.position_embedding_type=rope", "model.add_bias_linear=false"]


@pytest.mark.parametrize("name, overrides, architecture", [
    ("zoo/dense_xs", LLAMA_LIKE, LLAMA),
    ("zoo/dense_xs", LLAMA_LIKE + ["model.qk_layernorm=true"], QWEN3),
    ("zoo/dense_xs", LLAMA_LIKE + ["model.add_qkv_bias=true"], DMOE_GPT),
    ("zoo/mixtral_xs", ["moe.shared_expert_ffn_hidden_size=256", "moe.shared_expert_gate=true"], QWEN2_MOE),
    ("zoo/mixtral_xs", ["moe.shared_expert_ffn_hidden_size=256", "moe.shared_expert_gate=true",
                        "model.add_qkv_bias=true", "moe.router_renormalize=false"], QWEN2_MOE),
    ("zoo/mixtral_xs", ["moe.shared_expert_ffn_hidden_size=256"], DMOE_GPT),  # an ungated shared expert
    ("zoo/mixtral_xs", ["moe.router_num_groups=4", "moe.router_group_topk=2"], DMOE_GPT),
])
def test_models_of_the_dense_and_shared_expert_families(name, overrides, architecture):
    assert hf_architecture(resolve(load_config(name, overrides))) == architecture


@pytest.mark.parametrize("overrides, named", [
    (["moe.top_k=1", "moe.router_renormalize=false"], "moe.router_pre_softmax=true with moe.router_renormalize=false"),
    (["moe.router_score_function=sigmoid"], "moe.router_score_function=sigmoid"),
    (["moe.layer_freq=2"], "moe.layer_freq=2"),
    (["model.add_bias_linear=true"], "model.add_bias_linear=true"),
])
def test_a_mixtral_like_model_with_one_other_setting_is_ours_naming_it(overrides, named):
    cfg = resolve(load_config("zoo/mixtral_xs", overrides))
    assert hf_architecture(cfg) == DMOE_GPT
    why = why_not_stock(cfg)
    assert why.startswith("as Mixtral these settings differ: ") and named in why and why.count("; ") == 0


def test_a_dense_model_with_rope_is_ours_naming_why_not_gpt2():
    cfg = resolve(load_config("zoo/dense_xs", ["model.position_embedding_type=rope"]))
    assert hf_architecture(cfg) == DMOE_GPT
    assert why_not_stock(cfg) == "as GPT-2 these settings differ: model.position_embedding_type=rope (GPT-2: " \
                                 "learned_absolute)"


@pytest.mark.parametrize("name", ["zoo/capacity1.0_xs", "zoo/capacity2.0_small"])
def test_token_dropping_models_are_refused_naming_the_capacity(name):
    with pytest.raises(UsageError, match=r"no transformers equivalent: moe.expert_capacity_factor=\d"):
        hf_architecture(resolve(load_config(name)))
