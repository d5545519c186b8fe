"""model.multi_latent_attention's keys: Megatron-LM's flags, the rope_type default, and the
settings refused with it (each one problem naming its key)."""
import pytest

from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.config.environment import Environment
from megatron_dmoe.config.megatron_names import flags_to_overrides
from megatron_dmoe.config.validate import find_problems

MLA = ["model.multi_latent_attention=true", "model.position_embedding_type=rope", "model.normalization=RMSNorm",
       "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4",
       "model.v_head_dim=12", "training.device=cpu"]
# Transformer Engine "installed", so that only multi-latent attention refuses transformer_impl below
CPU = Environment(cuda=False, transformer_engine=True, apex=False, megatron_core=(0, 16))


def _problems(*overrides):
    return find_problems(load_config(None, list(overrides)), world_size=1, env=CPU)


def test_megatron_lm_flags_become_the_keys():
    argv = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--rope-type", "yarn", "--rotary-scaling-factor",
            "40", "--mscale", "0.707", "--mscale-all-dim", "0.707"]
    rest, overrides, problems, ignored = flags_to_overrides(argv, [])
    assert rest == [] and problems == [] and ignored == []
    assert overrides == ["model.multi_latent_attention=true", "model.q_lora_rank=24", "model.kv_lora_rank=16",
                         "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=12",
                         "model.rope_type=yarn", "model.rotary_scaling_factor=40", "model.mscale=0.707",
                         "model.mscale_all_dim=0.707"]


def test_rope_type_defaults_as_megatron_lm_chooses():
    assert resolve(load_config(None, MLA)).model.rope_type == "yarn"
    assert resolve(load_config(None, [])).model.rope_type == "rope"
    assert resolve(load_config(None, [*MLA, "model.rope_type=rope"])).model.rope_type == "rope"
    assert _problems(*MLA) == []


@pytest.mark.parametrize("overrides, key, fragment", [
    (["model.position_embedding_type=learned_absolute"], "model.position_embedding_type", "use rope"),
    (["model.num_query_groups=2"], "model.num_query_groups", "no grouped-query attention"),
    (["model.kv_channels=16"], "model.kv_channels", "model.qk_head_dim"),
    (["model.add_qkv_bias=true"], "model.add_qkv_bias", "without biases"),
    (["model.qk_pos_emb_head_dim=5"], "model.qk_pos_emb_head_dim", "even"),
    (["model.qk_layernorm=true", "model.qk_layernorm_scope=projection"], "model.qk_layernorm_scope", "latents"),
    (["model.transformer_impl=transformer_engine"], "model.transformer_impl", "local modules"),
    (["model.kv_lora_rank=0"], "model.kv_lora_rank", ">= 1"),
    (["model.rope_type=ntk"], "model.rope_type", "rope"),
])
def test_settings_it_cannot_build_are_refused_by_key(overrides, key, fragment):
    problems = _problems(*MLA, *overrides)
    keys = [k for k, _ in problems]
    assert key in keys, problems
    assert fragment in dict(problems)[key]


def test_yarn_without_multi_latent_attention_is_refused():
    problems = dict(_problems("model.position_embedding_type=rope", "model.rope_type=yarn", "training.device=cpu"))
    assert "multi-latent attention only" in problems["model.rope_type"]
