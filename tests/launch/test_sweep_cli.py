"""dmoe-sweep's command line: --dry-run listings, errors before anything is written or submitted,
and the job array it submits (to a stand-in sbatch that records its call)."""
import os
import stat
from pathlib import Path

import pytest

from megatron_dmoe.cli import sweep_main
from megatron_dmoe.config import load_config

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"

GRID_AND_ZIP = """
base: tiny
overrides: {training.train_iters: 40}
grid:
  moe.top_k: [1, 2]
zip:
  training.lr: [1.0e-3, 3.0e-3]
  training.min_lr: [1.0e-4, 3.0e-4]
slurm: {partition: cpu, exclusive: true}
"""


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """An `sbatch` first on PATH that records its arguments and RUN_LIST, and prints a job id."""
    bin_dir, record = tmp_path / "bin", tmp_path / "sbatch-call"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "RUN_LIST=$RUN_LIST" > "{record}"\n'
                      'echo 4242\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def _sweep(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_dry_run_lists_every_run_and_writes_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "--dry-run", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "sweep sweep: 4 runs of" in out and "checked for this machine" in out
    assert "every run: training.train_iters=40" in out
    expected = [(k, lr, mlr) for k in (1, 2) for lr, mlr in (("0.001", "0.0001"),
                                                             ("0.003", "0.0003"))]
    rows = [line.split() for line in out.splitlines() if line.startswith("  top_k=")]
    assert len(rows) == 4
    for row, (k, lr, mlr) in zip(rows, expected):
        name = f"top_k={k},lr={lr},min_lr={mlr}"
        assert row == [name, str(runs / name), f"moe.top_k={k}", f"training.lr={lr}",
                       f"training.min_lr={mlr}"]
    assert not runs.exists()


def test_dry_run_for_slurm_shows_the_array_it_would_submit(tmp_path, capsys, fake_sbatch):
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "--dry-run", "--slurm",
                       "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "checked for SLURM nodes with GPUs" in out
    assert "--array=0-3" in out and "--partition=cpu --exclusive" in out
    assert str(SBATCH_SCRIPT) in out
    assert not runs.exists() and not fake_sbatch.exists()


def test_slurm_submits_one_array_over_the_written_run_directories(tmp_path, capsys, fake_sbatch):
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "--slurm", "--runs-dir", str(runs)]) == 0
    assert "submitted job array 4242 with 4 runs" in capsys.readouterr().out
    call = fake_sbatch.read_text().splitlines()
    listed = (runs / "runs.txt").read_text().splitlines()
    assert call == ["--parsable", "--array=0-3", "--job-name=sweep",
                    f"--output={runs.resolve()}/slurm-%A_%a.out", "--export=ALL",
                    "--partition=cpu", "--exclusive", str(SBATCH_SCRIPT),
                    f"RUN_LIST={runs.resolve() / 'runs.txt'}"]
    assert len(listed) == 4
    for line, lr in zip(listed, ("0.001", "0.003", "0.001", "0.003")):
        cfg = load_config(str(Path(line) / "config.yaml"))  # written before submission
        assert f"lr={lr}" in Path(line).name and cfg.training.lr == float(lr)
        assert cfg.training.train_iters == 40
    assert (runs / "sweep.yaml").read_text() == GRID_AND_ZIP


def test_command_line_overrides_are_set_in_every_run(tmp_path, capsys, fake_sbatch):
    runs = tmp_path / "runs"
    # over the sweep file's own training.train_iters: 40; they may follow the flags too
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "training.train_iters=7", "--slurm",
                       "--runs-dir", str(runs), "moe.aux_loss_coeff=0.02"]) == 0
    listed = (runs / "runs.txt").read_text().splitlines()
    assert len(listed) == 4
    for line in listed:
        cfg = load_config(str(Path(line) / "config.yaml"))
        assert (cfg.training.train_iters, cfg.moe.aux_loss_coeff) == (7, 0.02)
    assert "every run: training.train_iters=7 moe.aux_loss_coeff=0.02" in _dry_run(tmp_path, capsys,
                                                                                 "training.train_iters=7",
                                                                                 "moe.aux_loss_coeff=0.02")


def _dry_run(tmp_path, capsys, *overrides):
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "--dry-run", *overrides]) == 0
    return capsys.readouterr().out


def test_command_line_overrides_the_sweep_varies_or_misspells_are_refused(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "moe.top_k=1", "training.trainiters=3",
                       "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("dmoe-sweep: error: invalid sweep") and "command line's overrides (2 problems)" in err[0]
    assert err[1:] == ["  moe.top_k: is varied in the sweep's grid; leave it out of the command line's overrides",
                       "  training.trainiters: unknown key; did you mean training.train_iters?"]
    assert not runs.exists()


@pytest.mark.parametrize("text, message", [
    ("base: tiny\ngrid: {moe.top_kk: [1, 2]}\n", "did you mean moe.top_k?"),
    ("base: tiny\ngrid: {moe.top_k: [1, 2]}\nzip: {training.lr: []}\n", "empty list"),
    ("base: tiny\ngrid: {moe.top_k: [1, 99]}\n", "moe.top_k: 99 is larger than moe.num_experts"),
])
@pytest.mark.parametrize("mode", [[], ["--slurm"]], ids=["local", "slurm"])
def test_a_bad_sweep_fails_before_anything_is_written_or_submitted(tmp_path, capsys, fake_sbatch,
                                                                   text, message, mode):
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, text)), "--runs-dir", str(runs), *mode]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dmoe-sweep: error: invalid sweep") and message in err
    assert "Traceback" not in err
    assert not runs.exists(), "a run directory was written"
    assert not fake_sbatch.exists(), "sbatch was called"


def test_slurm_without_sbatch_fails_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    runs = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, GRID_AND_ZIP)), "--slurm", "--runs-dir", str(runs)]) == 2
    assert "sbatch was not found on PATH" in capsys.readouterr().err
    assert not runs.exists()


@pytest.mark.parametrize("argv, message", [
    ([], "give a SWEEP.yaml to run, or --summary DIR"),
    (["s.yaml", "--summary", "d"], "give a SWEEP.yaml to run, or --summary DIR"),
    (["--summary", "d", "--slurm"], "--summary takes only --plot"),
    (["s.yaml", "--slurm", "--plot", "x.png"], "--plot needs finished runs"),
    (["s.yaml", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    (["s.yaml", "--concurrent", "0"], "--concurrent must be at least 1"),
    (["s.yaml", "--concurrent", "2", "--slurm"],
     "--concurrent is for local runs: a SLURM job array already runs its tasks at the same time"),
    (["s.yaml", "--concurrent", "1", "--slurm"], "leave --concurrent out with --slurm"),
    (["--summary", "d", "--concurrent", "2"], "--summary takes only --plot"),
    (["--summary", "d", "moe.top_k=1"], "give a SWEEP.yaml to run, or --summary DIR"),
])
def test_usage_mistakes(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        sweep_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # as one line, however argparse wraps it
    for flag in ("--dry-run", "--slurm", "--runs-dir", "--summary", "--plot", "--nproc-per-node",
                 "--concurrent", "share the CPU", "CUDA_VISIBLE_DEVICES", "--sbatch-script",
                 "grid:", "zip:", "overrides:", "base:", "slurm:"):
        assert flag in out
