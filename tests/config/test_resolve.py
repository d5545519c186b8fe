"""resolve(): derived defaults filled, explicit values kept, input untouched, idempotent."""
import copy

import pytest

from megatron_dmoe.config import RunConfig, load_config, resolve


def test_derived_defaults():
    cfg = RunConfig()
    cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.seq_length = 96, 6, 40
    cfg.training.train_iters = 77
    out = resolve(cfg)
    assert out.model.ffn_hidden_size == 384
    assert out.model.max_position_embeddings == 40
    assert out.model.num_query_groups == 6
    assert out.moe.ffn_hidden_size == 384
    assert out.training.lr_decay_iters == 77
    assert out.model.vocab_size is None  # left to the tokenizer


def test_swiglu_keeps_four_times_hidden():
    cfg = RunConfig()
    cfg.model.activation, cfg.model.hidden_size = "swiglu", 64
    assert resolve(cfg).model.ffn_hidden_size == 256


def test_expert_width_follows_an_explicit_dense_width():
    cfg = RunConfig()
    cfg.model.ffn_hidden_size = 200
    assert resolve(cfg).moe.ffn_hidden_size == 200


def test_explicit_values_are_kept_and_input_is_not_changed():
    cfg = RunConfig()
    cfg.model.ffn_hidden_size, cfg.model.max_position_embeddings = 100, 512
    cfg.model.num_query_groups, cfg.moe.ffn_hidden_size = 2, 64
    cfg.moe.router_renormalize, cfg.training.lr_decay_iters = True, 5
    cfg.model.rope_type = "rope"
    before = copy.deepcopy(cfg)
    out = resolve(cfg)
    assert out == before and out is not cfg
    assert resolve(RunConfig()) != RunConfig() and RunConfig().model.ffn_hidden_size is None


@pytest.mark.parametrize("score, top_k, pre_softmax, expected", [
    ("sigmoid", 1, False, False),
    ("sigmoid", 2, False, True),
    ("sigmoid", 4, True, True),
    ("softmax", 2, True, False),   # probabilities over all experts, as Megatron keeps them
    ("softmax", 1, True, False),
    ("softmax", 2, False, True),
])
def test_router_renormalize_default(score, top_k, pre_softmax, expected):
    cfg = RunConfig()
    cfg.moe.router_score_function, cfg.moe.top_k = score, top_k
    cfg.moe.router_pre_softmax = pre_softmax
    assert resolve(cfg).moe.router_renormalize is expected


def test_resolve_is_idempotent(tiny_config):
    once = resolve(tiny_config)
    assert resolve(once) == once


def test_a_virtual_pipeline_size_of_one_is_no_interleaving():
    cfg = resolve(load_config(None, ["parallel.pipeline_model_parallel_size=2",
                                     "parallel.virtual_pipeline_model_parallel_size=1"]))
    assert cfg.parallel.virtual_pipeline_model_parallel_size is None
    two = resolve(load_config(None, ["parallel.pipeline_model_parallel_size=2",
                                     "parallel.virtual_pipeline_model_parallel_size=2"]))
    assert two.parallel.virtual_pipeline_model_parallel_size == 2
