"""The README's quick start: `dmoe-train` with no arguments trains the built-in default run."""
import json

import matplotlib.image

from train_helpers import run_train


def test_default_run_learns_evaluates_and_leaves_its_artifacts(tmp_path, corpus_cache):
    # Only the corpus cache is redirected (shared with the other end-to-end tests); the run is
    # the shipped default otherwise.
    result = run_train(tmp_path / "run", f"data.cache_dir={corpus_cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the default stays a quick run by its size: 200 steps of 16 x 128 tokens, all of them trained
    assert records[-1]["step"] == 200 and records[-1]["tokens"] == 200 * 16 * 128, records[-1]
    train_losses = [r["loss"] for r in records]
    assert train_losses[-1] < (2 / 3) * train_losses[0], train_losses
    assert any("val_loss" in r for r in records)
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "lb_loss", "expert_load_imbalance"):
        assert key in records[-1], key
    assert (run / "checkpoints" / "latest").read_text().strip() == str(records[-1]["step"])
    assert (run / "config.yaml").read_text().count("versions:") == 1
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    picture = matplotlib.image.imread(run / "loss.png")
    assert picture.shape[0] > 100 and picture.shape[1] > 100
    assert (run / "expert_load.png").exists()
