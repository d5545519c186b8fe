"""scripts/megatron_lm_check.sh without a GPU: its help, the arguments it refuses before any work, and
the per-iteration comparison of two Megatron-LM logs (--compare). The runs themselves need GPUs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "megatron_lm_check.sh")


def _check(*args, env=None):
    return subprocess.run(["bash", SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=60,
                          env=env)


def _log(path, losses):
    """A Megatron-LM training log: one line per iteration, as its training loop writes them."""
    lines = [f" [2026-11-27 10:00:00] iteration {i:8d}/{len(losses):8d} | consumed samples: {16 * i:12d} | "
             f"lm loss: {loss} | load_balancing_loss: 1.012000E+00 | number of nan iterations:   0 |"
             for i, loss in enumerate(losses, start=1)]
    validation = "validation loss at iteration 3 | lm loss value: 9.9E+00"
    path.write_text("\n".join(["building the model ...", *lines, validation]) + "\n")
    return path


def test_help_names_the_starting_checkpoint_the_comparison_and_the_port():
    proc = _check("--help")
    assert proc.returncode == 0
    for text in ("--init DIR", "--load DIR --finetune", "--compare LOG", "MASTER_PORT", "--etp N",
                 "--expert-tensor-parallel-size"):
        assert text in proc.stdout


def test_compare_within_tolerance(tmp_path):
    ref = _log(tmp_path / "ref.log", ["1.040000E+01", "9.500000E+00", "8.800000E+00"])
    run = _log(tmp_path / "run.log", ["1.040100E+01", "9.510000E+00", "8.800000E+00"])
    proc = _check("--compare", run, "--reference", ref)
    assert proc.returncode == 0, proc.stderr
    assert "ok: lm loss within 2e-2" in proc.stdout
    assert "3 iterations compared, largest difference 0.01 (iteration 2)" in proc.stdout


def test_compare_fails_past_the_tolerance(tmp_path):
    ref = _log(tmp_path / "ref.log", ["1.040000E+01", "9.500000E+00", "8.800000E+00"])
    run = _log(tmp_path / "run.log", ["1.040000E+01", "9.550000E+00", "8.800000E+00"])
    proc = _check("--compare", run, "--reference", ref)
    assert proc.returncode == 1
    assert "largest difference 0.05 (iteration 2)" in proc.stderr
    assert _check("--compare", run, "--reference", ref, "--tolerance", "0.1").returncode == 0


def test_compare_fails_when_the_log_lacks_an_iteration_of_the_reference(tmp_path):
    # a loss that is not a number (or a run cut short) leaves the iteration out of the log's losses
    ref = _log(tmp_path / "ref.log", ["1.040000E+01", "9.500000E+00", "8.800000E+00"])
    run = _log(tmp_path / "run.log", ["1.040000E+01", "nan", "8.800000E+00"])
    proc = _check("--compare", run, "--reference", ref)
    assert proc.returncode == 1
    assert "2 iterations compared" in proc.stderr and "1 of the reference's 3 iterations missing" in proc.stderr


@pytest.mark.parametrize("args, env, message", [
    (["MLM", "--pp", "x"], {}, "--pp x: give a positive integer"),
    (["MLM", "--etp", "0"], {}, "--etp 0: give a positive integer"),
    (["MLM", "--ep", "2", "--etp", "2", "--nproc", "2"], {},
     "--ep 2 x --etp 2 does not divide the 2 processes of a pipeline stage"),
    (["MLM", "--sp"], {}, "--sp splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more"),
    (["MLM", "--tolerance", "0"], {}, "--tolerance 0: give a positive number"),
    (["MLM"], {"MASTER_PORT": "port"}, "MASTER_PORT 'port': give a port number"),
    (["MLM", "--init", "{tmp}/file"], {}, "--init {tmp}/file is a file: give a checkpoint folder"),
    (["MLM", "--init", "{tmp}/other"], {}, "--init {tmp}/other holds files but no Megatron-LM checkpoint"),
    (["--compare", "{tmp}/file"], {}, "--compare {tmp}/file needs --reference LOG"),
    (["MLM", "--compare", "{tmp}/file", "--reference", "{tmp}/file"], {}, "--compare LOG runs nothing"),
    (["--compare", "{tmp}/absent.log", "--reference", "{tmp}/file"], {},
     "--compare {tmp}/absent.log: no such log file"),
])
def test_refused_in_one_line_before_any_work(tmp_path, monkeypatch, args, env, message):
    (tmp_path / "file").write_text("x\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint\n")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = _check(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megatron_lm_check: error: {message.format(tmp=tmp_path)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "other"]


def test_a_new_init_folder_is_not_made_before_the_checkout_is_checked(tmp_path):
    proc = _check(tmp_path / "no-checkout", "--init", tmp_path / "new" / "init")
    assert proc.returncode == 2
    assert "MEGATRON_LM_DIR" in proc.stderr and "is not a folder" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_copy_inside_another_repository_is_known_by_its_package_info(tmp_path):
    # the tag of the enclosing repository (this project's, for .mlm/) is not the copy's release
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for command in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"], ["tag", "v9"]):
        subprocess.run(["git", "-C", str(tmp_path), *command], check=True, env=env)
    core = tmp_path / "copy" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\n")
    proc = _check(tmp_path / "copy", env={**os.environ, "PYTHON": sys.executable})
    assert "Megatron-LM checkout at core_v0.19.1" in proc.stdout
    assert proc.returncode == 2 and "pretrain_gpt.py is missing" in proc.stderr
