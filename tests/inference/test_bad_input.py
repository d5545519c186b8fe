"""Bad input to dmoe-eval / dmoe-generate / dmoe-export: one line on stderr naming the problem, exit 2."""
import shutil

import pytest

from megatron_dmoe.export.cli import export_main
from megatron_dmoe.inference.eval_cli import eval_main
from megatron_dmoe.inference.generate_cli import generate_main


def _one_error_line(capsys, prog, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: ")
    for word in words:
        assert word in err[0], err[0]


@pytest.fixture
def without_checkpoint(runs, tmp_path):
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    shutil.copy(runs["mixtral"] / "config.yaml", run_dir / "config.yaml")
    return run_dir


@pytest.mark.parametrize("main, prog, extra", [
    (eval_main, "dmoe-eval", []),
    (generate_main, "dmoe-generate", ["--prompt", "x"]),
    (export_main, "dmoe-export", ["OUT"]),
])
def test_a_run_without_checkpoint_is_refused(main, prog, extra, without_checkpoint, tmp_path, capsys):
    extra = [str(tmp_path / e) if e == "OUT" else e for e in extra]
    assert main([str(without_checkpoint), *extra]) == 2
    _one_error_line(capsys, prog, "no checkpoint", str(without_checkpoint))


def test_a_directory_that_is_no_run_is_refused(tmp_path, capsys):
    assert eval_main([str(tmp_path)]) == 2
    _one_error_line(capsys, "dmoe-eval", "config.yaml")


def test_an_unknown_checkpoint_iteration_is_refused(runs, tmp_path, capsys):
    assert export_main([str(runs["dense"]), str(tmp_path / "out"), "--checkpoint", "7"]) == 2
    _one_error_line(capsys, "dmoe-export", "--checkpoint 7", "saved iterations: 2")


def test_an_unknown_format_is_refused(runs, tmp_path, capsys):
    assert export_main([str(runs["dense"]), str(tmp_path / "out"), "--format", "onnx"]) == 2
    _one_error_line(capsys, "dmoe-export", "'onnx'", "hf")
    assert not (tmp_path / "out").exists()


def test_a_model_without_equivalent_is_refused_naming_its_settings(runs, tmp_path, capsys):
    run_dir = tmp_path / "capacity_moe"
    run_dir.mkdir()
    text = (runs["mixtral"] / "config.yaml").read_text()
    assert "expert_capacity_factor: null" in text
    (run_dir / "config.yaml").write_text(text.replace("expert_capacity_factor: null", "expert_capacity_factor: 1.0"))
    assert export_main([str(run_dir), str(tmp_path / "out")]) == 2
    _one_error_line(capsys, "dmoe-export", "no transformers equivalent", "moe.expert_capacity_factor=1.0")
    assert not (tmp_path / "out").exists()


def test_missing_or_weighted_datasets_are_refused(runs, tmp_path, capsys):
    assert eval_main([str(runs["mixtral"]), "--data-path", str(tmp_path / "nothing")]) == 2
    _one_error_line(capsys, "dmoe-eval", "--data-path", str(tmp_path / "nothing") + ".bin")
    assert eval_main([str(runs["mixtral"]), "--data-path", "0.5", "a", "0.5", "b"]) == 2
    _one_error_line(capsys, "dmoe-eval", "without weights")


def test_a_prompt_longer_than_the_context_is_refused(runs, capsys):
    assert generate_main([str(runs["mixtral"]), "--device", "cpu", "--prompt", "word " * 200]) == 2
    _one_error_line(capsys, "dmoe-generate", "more than the model's context of 64")


def test_the_console_command_prints_one_line_and_no_warnings(without_checkpoint, tmp_path):
    """As a subprocess: megatron-core's import-time notices must not reach stderr either."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "megatron_dmoe.export.cli", str(without_checkpoint),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmoe-export: error: ") and "no checkpoint" in lines[0], lines
