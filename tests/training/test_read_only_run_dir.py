"""A run directory that cannot be written (a read-only run directory, a read-only folder above a
new one, a read-only checkpoints/) is one line naming the path and what to do, never a traceback;
the directory stays byte-identical and `latest` keeps naming the last complete checkpoint. A
read-only --runs-dir of dmoe-sweep is one line too.

The read-only places are real read-only bind mounts: the tests run as root, for whom chmod alone
does not make a directory unwritable."""
import contextlib
import subprocess
import warnings
from pathlib import Path

import pytest

from train_helpers import small_args, snapshot


@contextlib.contextmanager
def read_only(path):
    """``path`` mounted read-only over itself for the duration."""
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root and mount): no read-only directory to test with")
    try:
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _one_line(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert message.startswith("dmoe-train: error: cannot write to "), message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.fixture
def finished_run(cli_run, tmp_path_factory, corpus_cache):
    """A run directory holding a complete checkpoint at step 1."""
    run = tmp_path_factory.mktemp("finished") / "run"
    result = cli_run(run, *small_args(corpus_cache, 1, "checkpoint.save_interval=1"))
    assert result.returncode == 0, result.stderr
    return run


def test_read_only_run_directory_and_parent_are_refused_before_anything_runs(cli_run, finished_run, tmp_path,
                                                                           corpus_cache):
    args = small_args(corpus_cache, 2, "checkpoint.save_interval=1")
    before = snapshot(finished_run)
    with read_only(finished_run):
        resumed = cli_run(finished_run, *args, "--resume")
    _one_line(resumed, f"cannot write to {finished_run} (the run directory): a read-only file system",
              "choose another --run-dir")
    assert snapshot(finished_run) == before
    assert (finished_run / "checkpoints" / "latest").read_text() == "1"

    parent = tmp_path / "parent"
    parent.mkdir()
    with read_only(parent):
        new = cli_run(parent / "a" / "run", *args)
    _one_line(new, f"cannot write to {parent} (the folder to create the run directory in)")
    assert list(parent.iterdir()) == []


def test_read_only_checkpoints_keep_latest(cli_run, finished_run, corpus_cache, monkeypatch):
    ckpts = finished_run / "checkpoints"
    before = snapshot(ckpts)
    # the saved schedule kept (no warning of the rate jumping back up): the error is the one line
    args = small_args(corpus_cache, 2, "checkpoint.save_interval=1", "training.lr_decay_iters=1")
    with read_only(ckpts):
        refused = cli_run(finished_run, *args, "--resume")
        _one_line(refused, f"cannot write to {ckpts} (its checkpoints): a read-only file system")
        # the save itself, should the folder turn read-only during the run: its own cleanup must not
        # hide the message
        monkeypatch.setattr("megatron_dmoe.training.run_dir.unwritable_run_dir", lambda run_dir: None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # shown however often they were shown before in this process
            failed = cli_run(finished_run, *args, "--resume")
    # loading the checkpoint is silent: torch's and megatron-core's notices about their internals
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    assert failed.returncode == 2, failed.stderr
    message = failed.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert "cannot save the checkpoint of step 2" in message and "Read-only file system" in message, message
    assert f"{ckpts / 'iter_0000001'} stays latest" in message, message
    assert snapshot(ckpts) == before
    assert (ckpts / "latest").read_text() == "1"


def test_read_only_sweep_runs_dir(tmp_path, capsys):
    from megatron_dmoe.cli import sweep_main

    root = tmp_path / "runs"
    root.mkdir()
    sweep = str(Path(__file__).resolve().parents[2] / "configs" / "sweeps" / "tiny_topk_lr.yaml")
    with read_only(root):
        code = sweep_main([sweep, "--runs-dir", str(root / "sweep")])
    message = capsys.readouterr().err.strip()
    assert code == 2 and len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert message == (f"dmoe-sweep: error: cannot write {root / 'sweep'}: no permission to write (Read-only file "
                       "system); make it writable or choose another --runs-dir"), message
    assert list(root.iterdir()) == []
