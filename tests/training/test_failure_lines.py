"""Failures a user meets after the first hour each end in one line (no traceback) that names the
file or setting and what to do, with exit 2 (130 for an interrupt); the run directory stays intact
and no temporary file is left."""
import shutil

import pytest

from train_helpers import small_args, snapshot


def _one_line(result, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    return message


def test_an_override_without_a_value_is_a_malformed_override(cli_run, tmp_path):
    message = _one_line(cli_run(tmp_path / "run", "training.train_iters"))
    assert "training.train_iters: a malformed override: it has no value" in message
    assert "training.train_iters=VALUE" in message and "config not found" not in message
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, corpus_cache):
    """A finished 2-step run with checkpoints at steps 1 and 2 (trained once; tests damage copies)."""
    from megatron_dmoe.cli import train_main

    run = tmp_path_factory.mktemp("two") / "run"
    assert train_main(small_args(corpus_cache, 2, "checkpoint.save_interval=1") + ["--run-dir", str(run)]) == 0
    return run


DAMAGE = {  # what is done to the newest checkpoint, and the file the message must name
    "common.pt cut off": (lambda d: _cut(d / "common.pt", 1000), "common.pt cannot be read, as when cut off"),
    "metadata.json cut off": (lambda d: _cut(d / "metadata.json", 40), "metadata.json cannot be read"),
    "index cut off": (lambda d: _cut(d / ".metadata", 5000), ".metadata cannot be read, as when cut off"),
    "shard cut off": (lambda d: _cut(d / "__0_1.distcp", 100000), "__0_1.distcp is cut off (100000 of "),
    "shard empty": (lambda d: _cut(d / "__0_0.distcp", 0), "__0_0.distcp is empty"),
    "shard missing": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
}


def _cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_names_the_file_and_offers_the_previous_one(cli_run, two_checkpoints, tmp_path,
                                                                                damage):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    ckpts = run / "checkpoints"
    do, named = DAMAGE[damage]
    do(ckpts / "iter_0000002")
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
