"""Config mistakes as a new user makes them: every problem reported at once (bad overrides, unknown
keys and what validation finds in the rest), YAML errors with the file and a 1-based position, a
mistyped shipped name with a did-you-mean and only the configs a run can start from, a sweep file
named to dmoe-train."""
import pytest

from megatron_dmoe.config import ConfigError, load_config
from megatron_dmoe.config.load import runnable_config_names, shipped_config_names


def _error_lines(result):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()


def test_every_problem_at_once(cli_run):
    lines = _error_lines(cli_run(None, "moe.moe_router_topk=2", "training.micro_batch_size=3", "moe.top_k=9"))
    assert lines[0] == "dmoe-train: error: invalid configuration (3 problems):", lines
    text = "\n".join(lines)
    assert "moe.moe_router_topk: unknown key; did you mean moe.top_k?" in text
    assert "moe.top_k: 9 is larger than moe.num_experts (8)" in text
    assert "training.global_batch_size: 16 is not divisible by training.micro_batch_size (3)" in text


def test_a_malformed_or_mistyped_override_hides_nothing(cli_run):
    # the bad num_experts keeps the config's 8 experts, so top_k=9 is still checked against them
    lines = _error_lines(cli_run(None, "moe.top_k=9", "training.foo", "moe.num_experts=x", "model.hidden_size=[1"))
    text = "\n".join(lines)
    assert lines[0] == "dmoe-train: error: invalid configuration (4 problems):", text
    assert "training.foo: an override must look like section.key=value" in text
    assert "moe.num_experts: expected an integer, got 'x'" in text
    assert "moe.top_k: 9 is larger than moe.num_experts (8)" in text
    assert "model.hidden_size: cannot read the value '[1' of the override as YAML: line 1, column 3: " in text


def test_invalid_yaml_names_the_file_and_the_position(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: [128\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"invalid configuration: {path}: not valid YAML at line 4, column 1: "
                              "expected ',' or ']', but got '<stream end>'"), message
    assert "(while parsing a flow sequence that starts at line 3, column 16)" in message
    assert "<unicode string>" not in message and "^" not in message


def test_a_mistyped_shipped_name_gets_a_did_you_mean_and_the_runnable_configs():
    with pytest.raises(ConfigError) as err:
        load_config("zoo/dmoe_xss")
    message = str(err.value)
    assert "did you mean zoo/dmoe_xs?" in message, message
    listed = message.split("shipped configs: ")[1].split(", ")
    assert listed == runnable_config_names()
    assert "tiny" in listed and "zoo/dmoe_small" in listed and "zoo/finegrained_swiglu" in listed
    left_out = set(shipped_config_names()) - set(listed)
    assert left_out and all(n.startswith("sweeps/") or n.endswith("base") or "/sizes/" in n for n in left_out)
    for name in listed:  # each one loads as a run config
        load_config(name)
    with pytest.raises(ConfigError, match="did you mean zoo/dmoe_small?"):
        load_config("dmoe_small")  # the name without its folder


def test_a_sweep_file_is_sent_to_dmoe_sweep(cli_run):
    lines = _error_lines(cli_run(None, "sweeps/tiny_topk_lr"))
    assert len(lines) == 1, lines
    assert "tiny_topk_lr.yaml: this is a sweep file (base:, grid:" in lines[0], lines
    assert lines[0].endswith("tiny_topk_lr.yaml"), lines
    assert "run it with dmoe-sweep " in lines[0] and "unknown section" not in lines[0]
