"""A run directory that holds a previous run is never reused without --resume or --overwrite; a
--resume that finds no checkpoint says that it starts a new run; a config path may contain '='."""
import pytest

from megatron_dmoe.cli import parse_train_args, train_main
from megatron_dmoe.config import load_config, save_config
from train_helpers import small_args, snapshot


def test_a_run_without_checkpoints_is_kept_unless_overwrite_is_passed(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    args = small_args(corpus_cache, 1, "checkpoint.save_interval=0")
    first = cli_run(run, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (run / "checkpoints").exists()
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)

    again = cli_run(run, *args)
    assert again.returncode == 2
    assert "--overwrite" in again.stderr and "--resume" in again.stderr and "metrics.jsonl" in again.stderr
    assert snapshot(run) == before

    replaced = cli_run(run, *small_args(corpus_cache, 2, "checkpoint.save_interval=0"), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    after = snapshot(run)
    assert after["notes.txt"] == before["notes.txt"]  # only the run's own files are replaced
    assert after["metrics.jsonl"] != before["metrics.jsonl"]


def test_overwrite_is_documented_and_excludes_resume(tmp_path, capsys):
    with pytest.raises(SystemExit) as help_:
        train_main(["--help"])
    assert help_.value.code == 0
    assert "--overwrite" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        train_main(["--run-dir", str(tmp_path), "--resume", "--overwrite"])
    assert exit_.value.code == 2
    assert "pass one" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_resume_without_checkpoint_says_it_starts_a_new_run(cli_run, tmp_path, corpus_cache, state):
    run = tmp_path / "misspelled"
    if state == "empty":
        run.mkdir()
    assert snapshot(run) == {}  # nothing there to lose
    result = cli_run(run, *small_args(corpus_cache, 1), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"no checkpoint in {run / 'checkpoints'}: starting a new run at step 0" in result.stdout
    assert (run / "checkpoints" / "latest").read_text() == "1"


def test_an_existing_config_file_wins_over_override_syntax(cli_run, tmp_path, corpus_cache):
    sweep_run = tmp_path / "top_k=1,lr=0.001"
    config = save_config(load_config(None, small_args(corpus_cache, 1)), sweep_run / "config.yaml")
    assert parse_train_args([str(config), "moe.top_k=1"])[1:] == (str(config), ["moe.top_k=1"])
    assert parse_train_args(["moe.top_k=1"])[1:] == (None, ["moe.top_k=1"])
    before = snapshot(sweep_run)
    result = cli_run(tmp_path / "other", str(config), "moe.top_k=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert snapshot(sweep_run) == before
