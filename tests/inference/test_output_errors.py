"""dmoe-export and dmoe-eval refuse an output they cannot write before any work (a read-only
destination), and a write that fails midway (a full disk) is one line with no partial output left.

The read-only places are read-only bind mounts: the tests run as root, for whom chmod alone does
not make a directory unwritable."""
import contextlib
import errno
import subprocess

import pytest

from inference_runs import COMMON, DENSE, make_untrained_run


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, corpus_cache):
    run = tmp_path_factory.mktemp("outputs") / "dense"
    make_untrained_run(run, COMMON + DENSE + [f"data.cache_dir={corpus_cache}"])
    return run


@contextlib.contextmanager
def read_only(path):
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root and mount): no read-only directory to test with")
    try:
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _one_line(code, capsys, prog):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{prog}: error: "), err
    return err


def test_export_to_a_read_only_folder_is_refused_before_loading(dense_run, tmp_path, capsys, monkeypatch):
    from megatron_dmoe.export import cli
    from megatron_dmoe.inference import run_model

    monkeypatch.setattr(run_model, "load_run", lambda *a, **k: pytest.fail("loaded before refusing"))
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        message = _one_line(cli.export_main([str(dense_run), str(folder / "hf")]), capsys, "dmoe-export")
    assert f"OUT {folder / 'hf'}: cannot write to {folder} (a read-only file system)" in message
    assert list(folder.iterdir()) == []


def test_export_to_a_full_disk_is_one_line_and_leaves_no_staging(dense_run, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    from megatron_dmoe.export.cli import export_main

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "hf"
    message = _one_line(export_main([str(dense_run), str(out)]), capsys, "dmoe-export")
    assert f"cannot write OUT {out}: no space left on the device" in message
    assert list(tmp_path.iterdir()) == []  # neither OUT nor OUT.tmp


def test_eval_out_to_a_read_only_folder_is_refused_before_evaluating(dense_run, tmp_path, capsys, monkeypatch):
    from megatron_dmoe.inference import eval_cli, evaluate

    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: pytest.fail("evaluated before refusing"))
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        message = _one_line(eval_cli.eval_main([str(dense_run), "--out", str(folder / "r.json")]), capsys,
                            "dmoe-eval")
    assert f"--out {folder / 'r.json'}: cannot write to {folder} (a read-only file system)" in message
