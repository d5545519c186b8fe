"""Run status (finished or not) and the sweep summary table and plot, on run directories written
here with random metrics."""
import json
import random

import pytest

from megatron_dmoe.cli import sweep_main
from megatron_dmoe.config import load_config, save_config
from megatron_dmoe.sweep import status as status_module
from megatron_dmoe.sweep.status import run_status
from megatron_dmoe.sweep.summary import find_runs, format_table, plot_summary, summarize_run


def _run_dir(path, train_iters=10, save_interval=None, logged=(), latest=None, val_every=0):
    """A run directory as training leaves it; returns the records written to metrics.jsonl."""
    save_config(load_config("tiny", [f"training.train_iters={train_iters}",
                                     f"checkpoint.save_interval={'null' if save_interval is None else save_interval}"]),
                path / "config.yaml")
    rng = random.Random(str(path))
    records = []
    for step in logged:
        record = {"step": step, "loss": rng.uniform(2, 9), "tokens_per_s": rng.uniform(1e3, 1e4)}
        if val_every and step % val_every == 0:
            record["val_loss"] = rng.uniform(2, 9)
        records.append(record)
    if records:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if latest is not None:
        (path / "checkpoints").mkdir()
        (path / "checkpoints" / "latest").write_text(f"{latest}\n")
    return records


def test_the_run_directory_layout_matches_training():
    from megatron_dmoe.training import checkpoint, run_dir

    assert status_module.CONFIG_FILE == run_dir.CONFIG_FILE
    assert status_module.CHECKPOINTS == run_dir.CHECKPOINTS
    assert status_module.LATEST == checkpoint.LATEST


def test_a_run_is_finished_when_its_last_checkpoint_is(tmp_path):
    assert not run_status(tmp_path).finished  # nothing there yet
    assert run_status(tmp_path).describe() == "not started (no config.yaml)"
    _run_dir(tmp_path, train_iters=10, logged=range(1, 11), latest=5)
    status = run_status(tmp_path)
    assert not status.finished and status.describe() == "step 10 of 10"  # final save missing
    (tmp_path / "checkpoints" / "latest").write_text("10")
    assert run_status(tmp_path).finished
    assert status_module.main([str(tmp_path)]) == 0
    (tmp_path / "checkpoints" / "latest").write_text("7")
    assert status_module.main([str(tmp_path)]) == 1


def test_without_checkpoints_the_metrics_tell(tmp_path):
    _run_dir(tmp_path, train_iters=10, save_interval=0, logged=range(1, 10))
    assert not run_status(tmp_path).finished
    _run_dir(tmp_path, train_iters=10, save_interval=0, logged=range(1, 11))
    assert run_status(tmp_path).finished


def test_summary_rows_come_from_the_metrics(tmp_path):
    records = _run_dir(tmp_path, train_iters=20, logged=range(2, 21, 2), val_every=4)
    row = summarize_run(tmp_path)
    assert row.step == 20 and row.train_iters == 20
    assert row.train_loss == records[-1]["loss"]
    assert row.val_loss == [r["val_loss"] for r in records if "val_loss" in r][-1]
    later = [r["tokens_per_s"] for r in records[1:]]  # the first interval includes start-up
    assert row.tokens_per_s == pytest.approx(sum(later) / len(later), rel=1e-12)


def test_summary_table_of_a_sweep_folder_in_sweep_order(tmp_path, capsys):
    runs = tmp_path / "runs"
    names = ["top_k=2", "top_k=1", "not_started"]
    for name, logged in zip(names, (range(1, 6), range(1, 4), ())):
        (runs / name).mkdir(parents=True)
        _run_dir(runs / name, train_iters=5, logged=logged)
    (runs / "runs.txt").write_text("".join(f"{runs / n}\n" for n in names))
    (runs / "not_a_run").mkdir()
    assert [p.name for p in find_runs(runs)] == names
    assert sweep_main(["--summary", str(runs), "--plot", str(tmp_path / "loss.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "steps", "train", "loss", "val", "loss", "tokens/s"]
    rows = [line.split() for line in lines[1:4]]
    assert [r[0] for r in rows] == names
    assert [r[1] for r in rows] == ["5/5", "3/5", "-/5"]
    expected = summarize_run(runs / "top_k=2")
    assert rows[0][2:] == [f"{expected.train_loss:.4f}", "-", f"{expected.tokens_per_s:.0f}"]
    assert rows[2][2:] == ["-", "-", "-"]
    assert lines[4] == f"loss curves: {tmp_path / 'loss.png'}"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_errors(tmp_path, capsys):
    assert sweep_main(["--summary", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert sweep_main(["--summary", str(tmp_path)]) == 2
    assert "no run directories in" in capsys.readouterr().err
    (tmp_path / "a").mkdir()
    _run_dir(tmp_path / "a", logged=())
    with pytest.raises(ValueError, match="none of the runs has logged a loss"):
        plot_summary([summarize_run(tmp_path / "a")], tmp_path / "x.png")
    assert format_table([summarize_run(tmp_path / "a")]).splitlines()[1].split() == \
        ["a", "-/10", "-", "-", "-"]
