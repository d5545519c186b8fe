"""Which shipped models export to transformers, and what a refusal names."""
import pytest

from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.export.hf_architecture import GPT2, MIXTRAL, hf_architecture
from megatron_dmoe.inference.errors import UsageError


@pytest.mark.parametrize("name, architecture", [("zoo/mixtral_xs", MIXTRAL), ("zoo/dense_xs", GPT2),
                                                ("zoo/dense_small", GPT2)])
def test_shipped_models_with_an_equivalent(name, architecture):
    assert hf_architecture(resolve(load_config(name))) == architecture


@pytest.mark.parametrize("overrides, named", [
    (["moe.top_k=1", "moe.router_renormalize=false"], "moe.router_pre_softmax=true with moe.router_renormalize=false"),
    (["moe.router_score_function=sigmoid"], "moe.router_score_function=sigmoid"),
    (["moe.layer_freq=2"], "moe.layer_freq=2"),
    (["moe.expert_capacity_factor=1.0"], "moe.expert_capacity_factor=1.0"),
    (["model.add_bias_linear=true"], "model.add_bias_linear=true"),
])
def test_a_mixtral_like_model_with_one_other_setting_is_refused_naming_it(overrides, named):
    with pytest.raises(UsageError) as err:
        hf_architecture(resolve(load_config("zoo/mixtral_xs", overrides)))
    assert named in str(err.value) and str(err.value).count("; ") == 1  # that setting alone


def test_a_dense_model_with_rope_is_refused_as_gpt2():
    with pytest.raises(UsageError, match=r"as GPT-2 these settings differ: model.position_embedding_type=rope"):
        hf_architecture(resolve(load_config("zoo/dense_xs", ["model.position_embedding_type=rope"])))
