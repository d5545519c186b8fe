"""What Megatron-LM's checkpoint and logging flags do here: checkpoint.load (--load) of another
run's checkpoint continues its steps exactly (weights, optimizer, schedule, RNG, data position);
load_optim false (--no-load-optim) gives the same next loss and then another; finetune (--finetune)
starts at step 1 from the loaded weights; logging.tensorboard_dir (--tensorboard-dir) takes the
events; W&B offline: the run's scalars are in the offline run file, read here with wandb's own
record format (skipped without wandb); without wandb the key is refused in one line."""
import glob
import json
import struct

import pytest

from train_helpers import small_args


def _records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_load_another_runs_checkpoint(cli_run, tmp_path, corpus_cache):
    args = small_args(corpus_cache, 4, "training.lr_warmup_iters=1")
    tb = tmp_path / "events"
    source = cli_run(tmp_path / "a", *args, "checkpoint.save_interval=2", "checkpoint.keep_last=0",
                     "logging.tensorboard=true", f"logging.tensorboard_dir={tb}")
    assert source.returncode == 0, source.stderr[-3000:]
    assert list(tb.glob("events.out.tfevents.*")) and not (tmp_path / "a" / "tensorboard").exists()
    a = _records(tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "iter_0000002"

    full = cli_run(tmp_path / "full", *args, "--load", str(ckpt))
    assert full.returncode == 0, full.stderr[-3000:]
    b = _records(tmp_path / "full")
    assert f"started from {ckpt} at step 2" in full.stdout
    assert sorted(b) == [3, 4]
    assert [b[s]["loss"] for s in (3, 4)] == [a[s]["loss"] for s in (3, 4)]
    assert [b[s]["grad_norm"] for s in (3, 4)] == [a[s]["grad_norm"] for s in (3, 4)]

    fresh = cli_run(tmp_path / "fresh_optim", *args, "--load", str(ckpt), "--no-load-optim")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    c = _records(tmp_path / "fresh_optim")
    assert sorted(c) == [3, 4]
    assert c[3]["loss"] == a[3]["loss"]  # the same weights on the same batch
    assert c[4]["loss"] != a[4]["loss"]  # after an update by fresh Adam moments
    assert c[3]["lr"] == a[3]["lr"]  # the schedule follows the step
    # a run directory names its newest checkpoint: step 4, the end of this run's length
    newest = cli_run(tmp_path / "newest", *args, "--load", str(tmp_path / "a"))
    assert newest.returncode == 0 and "training.train_iters=4 was reached at step 4" in newest.stdout

    tuned = cli_run(tmp_path / "tuned", *small_args(corpus_cache, 2, "training.lr_warmup_iters=1"),
                    "--load", str(ckpt), "--finetune")
    scratch = cli_run(tmp_path / "scratch", *small_args(corpus_cache, 2, "training.lr_warmup_iters=1"))
    assert tuned.returncode == scratch.returncode == 0, tuned.stderr[-3000:]
    d, e = _records(tmp_path / "tuned"), _records(tmp_path / "scratch")
    assert sorted(d) == [1, 2]
    assert e[1]["loss"] == a[1]["loss"]  # step 1 of a fresh run is the source's step 1
    assert d[1]["loss"] < e[1]["loss"]  # the same first batch, through the weights trained on it


def test_load_names_no_checkpoint(cli_run, tmp_path, corpus_cache):
    done = cli_run(tmp_path / "r", *small_args(corpus_cache, 1), "--load", str(tmp_path))
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and len(errors) == 1 and "holds no checkpoint" in errors[0]
    assert "checkpoint.load=" in errors[0] and not (tmp_path / "r").exists()  # nothing built or written


def test_wandb_is_refused_in_one_line_without_the_package(cli_run, tmp_path, monkeypatch):
    monkeypatch.setattr("megatron_dmoe.config.section_checks.logs.wandb_available", lambda: False)
    done = cli_run(tmp_path / "r", "--wandb-project", "p", "--wandb-exp-name", "x")
    assert done.returncode == 2 and not (tmp_path / "r").exists()
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "logging.wandb_project" in errors[0] and "megatron-dmoe[wandb]" in errors[0]


def _offline_history(run_file):
    """The history records of a W&B run file: its header (':W&B', magic, version), then LevelDB-log
    records in 32 KiB blocks (crc32, length, type: full, first, middle, last), each a wandb Record."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, history = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return history


def test_wandb_offline_run_holds_the_scalars(cli_run, tmp_path, corpus_cache, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "wandb_files"
    done = cli_run(tmp_path / "r", *small_args(corpus_cache, 3), "--wandb-project", "dmoe-test",
                   "--wandb-exp-name", "tiny", "--wandb-save-dir", str(save), "logging.wandb_mode=offline")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = glob.glob(str(save / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    history = {h["_step"]: h for h in _offline_history(runs[0])}
    records = _records(tmp_path / "r")
    assert sorted(history) == sorted(records) == [1, 2, 3]
    for step, record in records.items():
        for key in ("loss", "lr", "grad_norm", "lb_loss"):
            assert history[step][key] == pytest.approx(record[key], rel=1e-12), (step, key)
        assert history[step]["expert_load_imbalance/layer_1"] == pytest.approx(record["expert_load_imbalance"][0])
