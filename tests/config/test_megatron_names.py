"""Megatron-LM's flags and names where a user types them: dmoe-train accepts the flags that have a
key, and a Megatron-LM name typed as a key gets the key to use."""
import pytest

from megatron_dmoe.cli import train_main
from megatron_dmoe.config import ConfigError, load_config
from megatron_dmoe.config.fields import section_types
from megatron_dmoe.config.megatron_names import MEGATRON_KEYS, flags_to_overrides

OWN = ["--run-dir", "--resume", "-h", "--help"]


def test_flags_become_overrides():
    rest, overrides, problems, ignored = flags_to_overrides(
        ["tiny", "--micro-batch-size", "4", "--moe-router-topk=2", "--bf16", "--swiglu", "moe.aux_loss_coeff=0.1",
         "--data-path", "0.3", "a", "0.7", "b", "--run-dir", "runs/x", "--resume"], OWN)
    assert problems == [] and ignored == []
    assert rest == ["tiny", "moe.aux_loss_coeff=0.1", "--run-dir", "runs/x", "--resume"]
    assert overrides == ["training.micro_batch_size=4", "moe.top_k=2", "training.bf16=true",
                         "model.activation=swiglu", 'data.data_path=["0.3", "a", "0.7", "b"]']
    cfg = load_config(None, overrides)
    assert (cfg.training.micro_batch_size, cfg.moe.top_k, cfg.training.bf16) == (4, 2, True)
    assert cfg.model.activation == "swiglu" and cfg.data.data_path == ["0.3", "a", "0.7", "b"]


def test_every_mapped_flag_names_a_real_key():
    keys = {f"{section}.{key}" for section, fields in section_types().items() for key in fields}
    assert set(MEGATRON_KEYS.values()) <= keys


@pytest.mark.parametrize("argv, fragment", [
    (["--micro-batchsize", "4"], "did you mean --micro-batch-size?"),
    (["--no-such-flag"], "neither an option of this command nor a Megatron-LM flag"),
    (["--bf16=true"], "--bf16 takes no value"),
    (["--train-iters"], "--train-iters needs a value (it is training.train_iters)"),
])
def test_flag_problems_name_what_to_type(argv, fragment):
    _, _, problems, _ = flags_to_overrides(argv, OWN)
    assert len(problems) == 1 and fragment in problems[0]


def test_dmoe_train_accepts_a_megatron_flag(capsys):
    # an invalid train_iters stops the run at validation, after the flag was accepted
    assert train_main(["--micro-batch-size", "4", "--global-batch-size", "8", "training.train_iters=0"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err
    assert "note: Megatron-LM flag read as training.micro_batch_size=4" in err
    assert "training.train_iters: 0 is out of range" in err


def test_several_unknown_flags_are_one_line_each(capsys):
    with pytest.raises(SystemExit) as stop:
        train_main(["--micro-batchsize", "4", "--no-such-flag"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dmoe-train: error: ")]
    assert len(errors) == 2 and "did you mean --micro-batch-size?" in errors[0] and "--no-such-flag" in errors[1]


@pytest.mark.parametrize("override, fragment", [
    ("moe.moe_router_topk=2",
     "moe.moe_router_topk: unknown key; did you mean moe.top_k? (what Megatron-LM calls --moe-router-topk)"),
    ("moe.router_topk=2", "did you mean moe.top_k?"),
    ("moe.moe_aux_loss_coeff=0.1", "did you mean moe.aux_loss_coeff?"),
    ("model.num_moe_experts=8", "did you mean moe.num_experts?"),
    ("model.swiglu=true", "did you mean model.activation: swiglu?"),
    ("micro_batch_size=4", "did you mean training.micro_batch_size=4?"),
    ("moe_router_topk=2", "did you mean moe.top_k=2?"),
])
def test_megatron_names_typed_as_keys_get_our_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)
