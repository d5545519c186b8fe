"""Megatron-LM's GPT MoE launch flags: every flag of the Mixtral example and the MoE guide's
arguments is mapped to a key, accepted with no effect (named in one note) or refused in a line of
its own that names what to use; the README's table lists every flag the code knows, and the code
every flag of the table."""
import re
from pathlib import Path

import pytest

from megatron_dmoe.cli import parse_train_args
from megatron_dmoe.config import find_problems, load_config, resolve
from megatron_dmoe.config.environment import Environment
from megatron_dmoe.config.megatron_flags import NO_OPS, REFUSED, VALUE_MAPS
from megatron_dmoe.config.megatron_names import (
    FLAG_NAMES,
    MEGATRON_KEYS,
    SWITCHES,
    VALUE_SWITCHES,
    flags_to_overrides,
)
from megatron_lm_scripts import MOE_GUIDE, mixtral

OWN = ["--run-dir", "--resume", "--save", "--overwrite", "-h", "--help"]
README = Path(__file__).resolve().parents[2] / "README.md"
GPU = Environment(cuda=True, transformer_engine=False, apex=False)


def test_the_mixtral_script_maps_without_problems():
    rest, overrides, problems, ignored = flags_to_overrides(mixtral("ckpt"), OWN)
    assert problems == []
    assert rest == ["--save", "ckpt"]  # dmoe-train's own flag: the run directory
    assert ignored == ["--use-mcore-models", "--group-query-attention", "--no-masked-softmax-fusion",
                       "--no-position-embedding", "--moe-grouped-gemm", "--moe-token-dispatcher-type alltoall",
                       "--sequence-parallel (at tensor-parallel size 1 Megatron-LM turns it off too)"]
    cfg = resolve(load_config(None, overrides))
    m, moe, tr, ck, lg = cfg.model, cfg.moe, cfg.training, cfg.checkpoint, cfg.logging
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (2, 64, 128, 4)
    assert (m.num_query_groups, m.activation, m.normalization) == (2, "swiglu", "RMSNorm")
    assert (m.position_embedding_type, m.rotary_base) == ("rope", 1000000)
    assert (m.add_bias_linear, m.untie_embeddings_and_output_weights, m.init_method_std) == (False, True, 0.01)
    assert (moe.num_experts, moe.top_k, moe.aux_loss_type, moe.aux_loss_coeff) == (4, 2, "micro_batch", 0.01)
    assert (cfg.parallel.overlap_grad_reduce, cfg.parallel.overlap_param_gather) == (True, True)
    assert (tr.use_distributed_optimizer, tr.bf16, tr.lr_warmup_iters, tr.min_lr) == (True, True, 1, 1e-5)
    assert (ck.load, ck.load_optim, ck.load_rng, lg.tensorboard_dir) == ("ckpt", False, False, "ckpt/tensorboard")
    assert find_problems(cfg, world_size=1, env=GPU) == []


def test_save_and_load_of_one_directory_continue_the_run_there(capsys):
    ns, _, overrides = parse_train_args(mixtral("ckpt"))
    assert (ns.run_dir, ns.resume) == (Path("ckpt"), True)
    assert not any(o.startswith("checkpoint.load=") for o in overrides)
    assert "continuing the run there" in capsys.readouterr().err
    ns, _, overrides = parse_train_args(["--save", "new", "--load", "old"])
    assert (ns.run_dir, ns.resume, overrides) == (Path("new"), False, ["checkpoint.load=old"])
    with pytest.raises(SystemExit):
        parse_train_args(["--save", "a", "--run-dir", "b"])
    assert "name two directories" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_train_args(["--save", "a", "--load", "a", "--finetune"])
    assert "fine-tune into a new --save" in capsys.readouterr().err


def test_the_moe_guide_s_arguments_map_without_problems():
    rest, overrides, problems, ignored = flags_to_overrides(MOE_GUIDE, OWN)
    assert problems == [] and rest == []
    assert ignored == ["--moe-grouped-gemm", "--moe-permute-fusion", "--moe-token-dispatcher-type alltoall",
                       "--moe-shared-expert-overlap", "--moe-per-layer-logging"]
    cfg = resolve(load_config(None, ["model.num_layers=2", *overrides]))
    moe = cfg.moe
    assert (moe.aux_loss_type, moe.router_dtype, moe.router_score_function, moe.router_num_groups) == (
        "sequence", "fp32", "sigmoid", 4)
    assert (moe.first_dense_layers, moe.layer_freq, moe.shared_expert_ffn_hidden_size) == (1, 1, 64)
    assert find_problems(cfg, world_size=1, env=GPU) == []


@pytest.mark.parametrize("value, key, expected", [
    ("aux_loss", "moe.aux_loss_type", "micro_batch"), ("seq_aux_loss", "moe.aux_loss_type", "sequence"),
    ("global_aux_loss", "moe.aux_loss_type", "global"), ("none", "moe.aux_loss_coeff", 0.0)])
def test_load_balancing_types(value, key, expected):
    # none switches the loss off even when the coefficient comes later on the line
    _, overrides, problems, _ = flags_to_overrides(
        ["--moe-router-load-balancing-type", value, "--moe-aux-loss-coeff", "0.02"], OWN)
    cfg = load_config(None, overrides)
    section, name = key.split(".")
    assert problems == [] and getattr(getattr(cfg, section), name) == expected


def test_refusals_are_one_line_each_and_name_what_to_use(capsys):
    argv = ["--lr-warmup-fraction", "0.01", "--mock-data", "--recompute-method", "uniform",
            "--moe-router-load-balancing-type", "sinkhorn", "--optimizer", "sgd", "--no-such-flag", "--spec", "a", "b"]
    _, _, problems, _ = flags_to_overrides(argv, OWN)
    assert len(problems) == 7, problems
    assert "use --lr-warmup-iters" in problems[0] and "built-in corpus" in problems[1]
    assert "sinkhorn" in problems[3] and "use aux_loss, seq_aux_loss, global_aux_loss or none" in problems[3]
    with pytest.raises(SystemExit) as stop:
        parse_train_args(argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"dmoe-train: error: {p}" for p in problems]


def test_no_position_embedding_needs_rope():
    _, _, problems, _ = flags_to_overrides(["--no-position-embedding"], OWN)
    assert len(problems) == 1 and "--position-embedding-type rope" in problems[0]
    _, overrides, problems, ignored = flags_to_overrides(
        ["--no-position-embedding", "--position-embedding-type=rope"], OWN)
    assert (problems, ignored) == ([], ["--no-position-embedding"])


def test_sequence_parallel_is_kept_above_one_tensor_rank():
    _, overrides, _, ignored = flags_to_overrides(["--tensor-model-parallel-size", "2", "--sequence-parallel"], OWN)
    assert "parallel.sequence_parallel=true" in overrides and ignored == []


def test_the_tables_are_disjoint():
    mapped = set(MEGATRON_KEYS) | SWITCHES | set(VALUE_SWITCHES)
    assert not mapped & set(NO_OPS) and not mapped & set(REFUSED) and not set(NO_OPS) & set(REFUSED)
    assert not set(VALUE_MAPS) & (mapped | set(NO_OPS))


def _readme_flags():
    text = README.read_text()
    section = text[text.index("### Megatron-LM flags"):]
    section = section[:section.index("\n## ")]
    return set(re.findall(r"`--([a-z0-9-]+)", section))


def test_the_readme_table_lists_every_flag():
    """Every flag the code knows is in the README's table, and every flag there is known."""
    known = {n.replace("_", "-") for n in [*FLAG_NAMES, *VALUE_SWITCHES, *NO_OPS, *REFUSED, *VALUE_MAPS,
                                             "no_position_embedding", "save"]}
    listed = _readme_flags()
    assert not sorted(known - listed), f"add these to the README's Megatron-LM flags table: {sorted(known - listed)}"
    unknown = sorted(listed - known - {"run-dir", "resume", "overwrite", "help"})
    assert not unknown, f"the README's table lists flags the code does not know: {unknown}"
