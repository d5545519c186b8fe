"""Failures a user meets after the first hour each end in one line (no traceback) that names the
file or setting and what to do, with exit 2 (130 for an interrupt); the run directory stays intact
and no temporary file is left."""
import errno
import shutil

import pytest

from megatron_dmoe.config.environment import megatron_core_release
from train_helpers import small_args, snapshot


def _one_line(result, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    return message


def test_an_override_without_a_value_is_a_malformed_override(cli_run, tmp_path):
    message = _one_line(cli_run(tmp_path / "run", "training.train_iters"))
    assert ("training.train_iters: an override must look like section.key=value, and this malformed override has "
            "no value; write training.train_iters=VALUE") in message
    assert "config not found" not in message
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, corpus_cache):
    """A finished 2-step run with checkpoints at steps 1 and 2 (trained once; tests damage copies)."""
    from megatron_dmoe.cli import train_main

    run = tmp_path_factory.mktemp("two") / "run"
    assert train_main(small_args(corpus_cache, 2, "checkpoint.save_interval=1") + ["--run-dir", str(run)]) == 0
    return run


def _cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _cut_largest_shard(d):
    """The largest torch_dist shard cut to half: the file name and sizes the message must give."""
    shard = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    half = shard.stat().st_size // 2
    _cut(shard, half)
    return f"{shard.name} is cut off ({half} of "


DAMAGE = {  # what is done to the newest checkpoint, and the file the message must name (or do() returns it)
    "metadata.json cut off": (lambda d: _cut(d / "metadata.json", 40), "metadata.json cannot be read"),
    "index cut off": (lambda d: _cut(d / ".metadata", 5000), ".metadata cannot be read, as when cut off"),
    "shard cut off": (_cut_largest_shard, None),
    "shard empty": (lambda d: _cut(d / "__0_0.distcp", 0), "__0_0.distcp is empty"),
    "shard missing": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
}
if megatron_core_release() < (0, 19):  # 0.19 keeps the common state inside the torch_dist files
    DAMAGE["common.pt cut off"] = (lambda d: _cut(d / "common.pt", 1000), "common.pt cannot be read, as when cut off")


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_names_the_file_and_offers_the_previous_one(cli_run, two_checkpoints, tmp_path,
                                                                                damage):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    ckpts = run / "checkpoints"
    do, named = DAMAGE[damage]
    named = do(ckpts / "iter_0000002") or named
    before = snapshot(run)
    message = _one_line(cli_run(run, "training.train_iters=3", "--resume"))
    assert f"the checkpoint {ckpts / 'iter_0000002'} is damaged: {ckpts / 'iter_0000002'}/{named}" in message
    assert (f"the previous complete checkpoint is {ckpts / 'iter_0000001'}: to continue from it, write 1 into "
            f"{ckpts / 'latest'}, then run: dmoe-train --run-dir {run} --resume") in message
    assert snapshot(run) == before
    if damage == "shard cut off":  # the offer works: the run continues from step 1 and saves step 2 anew
        (ckpts / "latest").write_text("1")
        resumed = cli_run(run, "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed from {ckpts / 'iter_0000001'}" in resumed.stdout
        assert (ckpts / "latest").read_text() == "2"


def test_a_damaged_latest_marker_offers_the_newest_complete_checkpoint(cli_run, two_checkpoints, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / "checkpoints" / "latest").write_text("")
    message = _one_line(cli_run(run, "--resume"))
    assert (f"{run / 'checkpoints' / 'latest'} is damaged (it holds '', not an iteration); the newest complete "
            f"checkpoint is {run / 'checkpoints' / 'iter_0000002'}: write 2 into it") in message


def test_resuming_a_pipeline_run_in_one_process_names_the_saved_config_and_the_commands(cli_run, tmp_path,
                                                                                      corpus_cache):
    from megatron_dmoe.config import load_config, resolve, save_config

    run = tmp_path / "run"
    saved = resolve(load_config(None, small_args(corpus_cache, 2, "parallel.pipeline_model_parallel_size=2")))
    save_config(saved, run / "config.yaml", versions={})
    before = snapshot(run)
    message = _one_line(cli_run(run, "--resume", "training.train_iters=4"))
    assert (f"cannot resume {run} with 1 process: its saved config {run / 'config.yaml'} sets "
            "parallel.pipeline_model_parallel_size: 2, a layout of 2 processes; continue with: "
            f"dmoe-train --nproc-per-node 2 --run-dir {run} --resume training.train_iters=4, or: "
            f"dmoe-train --run-dir {run} --resume parallel.pipeline_model_parallel_size=1 training.train_iters=4"
            ) in message
    assert snapshot(run) == before


@pytest.mark.parametrize("env, command", [
    ({}, "dmoe-train --run-dir R --resume"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "dmoe-train --nproc-per-node 2 --run-dir R --resume"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
     "dmoe-train --nnodes 2 --nproc-per-node 4 (and this job's rendezvous) --run-dir R --resume"),
])
def test_resume_hints_name_the_command_for_the_runs_layout(monkeypatch, env, command):
    from megatron_dmoe.training.stops import resume_command

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resume_command("R") == command


def test_the_first_ctrl_c_is_acknowledged_at_once(capfd):
    import os
    import signal
    import time

    import torch

    from megatron_dmoe.training.stops import PreemptionWatcher

    watcher = PreemptionWatcher(device=torch.device("cpu"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes
    finally:
        watcher.close()
    assert capfd.readouterr().err == ("dmoe-train: SIGINT: stopping after this step, then saving; Ctrl-C again to "
                                      "stop without saving\n")


def test_a_second_ctrl_c_during_a_save_leaves_no_staging_directory(cli_run, tmp_path, corpus_cache, monkeypatch):
    import functools

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    run = tmp_path / "run"
    write_item = filesystem_async._write_item

    @functools.wraps(write_item)  # megatron reads its signature
    def interrupted_at_step_2(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "name") and hasattr(a, "write"))
        if "iter_0000002" in str(stream.name):
            stream.write(b"partial")
            raise KeyboardInterrupt  # what the watcher raises on a second Ctrl-C
        return write_item(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", interrupted_at_step_2)
    try:
        result = cli_run(run, *small_args(corpus_cache, 3, "checkpoint.save_interval=1"))
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped dmoe-train")
    message = _one_line(result, code=130)
    assert message == ("dmoe-train: interrupted without saving; the newest complete checkpoint (if any) is kept; "
                       f"continue with: dmoe-train --run-dir {run} --resume")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000001", "latest"]


def test_a_full_disk_under_metrics_jsonl_saves_the_checkpoint_and_ends_in_one_line(cli_run, tmp_path, corpus_cache,
                                                                                  monkeypatch):
    from megatron_dmoe.training import metrics_log

    class FullDisk:
        """metrics.jsonl's file once the disk is full: every write and flush fails, close too."""
        name = None

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))

    log = metrics_log.MetricsLogger.log

    def log_until_step_2(self, step, values):
        if step == 2:
            self._file = FullDisk()
        return log(self, step, values)

    monkeypatch.setattr(metrics_log.MetricsLogger, "log", log_until_step_2)
    run = tmp_path / "run"
    message = _one_line(cli_run(run, *small_args(corpus_cache, 4, "logging.tensorboard=false")))
    assert (f"cannot write {run / 'metrics.jsonl'}: no space left on the device (" in message
            and "free there); step 2 is not logged; the checkpoint of step 2 is saved; make room (or fix the "
            f"permissions), then continue with: dmoe-train --run-dir {run} --resume") in message
    assert (run / "checkpoints" / "latest").read_text() == "2"
    assert not list(run.rglob("*.tmp"))


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_bad_data_path_under_torchrun_is_told_once_before_the_process_group(cli_run, tmp_path, corpus_cache,
                                                                              monkeypatch, rank):
    from megatron_dmoe import cli
    from megatron_dmoe.data import prepare_builtin_corpus
    from megatron_dmoe.parallel import distributed

    # what torchrun sets for each of 2 workers; rank 1 would otherwise meet rank 0's exit in a barrier
    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "_QUIET_RANK_EXIT_DELAY_S", 0)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: pytest.fail("process group started"))
    _, tokenizer = prepare_builtin_corpus(4096, corpus_cache)  # a real tokenizer: the data files are what is wrong
    result = cli_run(tmp_path / "run", f"data.data_path=[{tmp_path}/missing_text_document]",
                     f"data.tokenizer_model={tokenizer}")
    if rank == "0":  # the data check's own message (it lists each missing file on a line of its own)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("dmoe-train: error: data files not found (data.data_path):")
        assert "missing_text_document.bin" in result.stderr
    else:
        assert result.returncode == 2 and result.stderr == "", result.stderr
    assert not (tmp_path / "run").exists()


def test_a_full_disk_under_the_final_plots_is_a_warning_after_a_complete_run(cli_run, tmp_path, corpus_cache,
                                                                           monkeypatch):
    from megatron_dmoe.training import plots

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "loss.png")

    monkeypatch.setattr(plots, "plot_runs", full_disk)
    run = tmp_path / "run"
    result = cli_run(run, *small_args(corpus_cache, 1, "logging.plot=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"dmoe-train: warning: cannot write the plots in {run}: no space left on the device ("
        + result.stderr.split("device (")[1].split(" free there)")[0]
        + f" free there); checkpoints and metrics.jsonl are complete: draw them later with tools/plot_runs.py "
        f"{run} --out loss.png")
    assert (run / "checkpoints" / "latest").read_text() == "1"
