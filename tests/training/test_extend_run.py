"""Extending a run: keys the user never set (the learning rate's decay length) follow the new
training.train_iters on resume, with one note; keys the user set keep their values. Where the
learning rate then jumps back up at the resumed step, a warning gives both rates."""
import json

import pytest

from megatron_dmoe.config import load_config, resolve, save_config
from megatron_dmoe.training.run_dir import resume_mismatches
from train_helpers import SMALL

DECAY = "training.lr_decay_iters"


def _lrs(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["lr"] for rec in map(json.loads, lines)}


def _saved_and_requested(tmp_path, first, resumed):
    """The saved config of a run started with `first` and the config a resume with `resumed`
    requests (read from that run's config.yaml, as dmoe-train --resume does)."""
    path = save_config(resolve(load_config(None, first)), tmp_path / "config.yaml", versions={})
    return resolve(load_config(str(path))), resolve(load_config(str(path), resumed))


def test_a_derived_decay_length_follows_train_iters_and_a_set_one_stays(tmp_path):
    saved, longer = _saved_and_requested(tmp_path, ["training.train_iters=5"], ["training.train_iters=10"])
    assert saved.training.lr_decay_iters == 5 and longer.training.lr_decay_iters == 10
    assert resume_mismatches(saved, longer) == []

    saved, kept = _saved_and_requested(tmp_path, ["training.train_iters=5", f"{DECAY}=5"], ["training.train_iters=10"])
    assert kept.training.lr_decay_iters == 5  # the user's value, though it equals the derived one
    assert resume_mismatches(saved, kept) == []

    # a decay length set now, where the run derived it, is a change of schedule: refused as before
    saved, changed = _saved_and_requested(tmp_path, ["training.train_iters=5"], [f"{DECAY}=7"])
    assert resume_mismatches(saved, changed) == [(DECAY, 5, 7)]


def test_the_learning_rate_jump_is_told_only_where_the_rate_rises():
    from megatron_dmoe.training.schedule_extension import lr_at, lr_jump_warning

    def cfg(*overrides):
        return resolve(load_config(None, ["training.lr_warmup_iters=2", "training.lr_decay_style=linear",
                                          *overrides]))

    short, longer = cfg("training.train_iters=10"), cfg("training.train_iters=20")
    # linear decay from lr 2e-3 to min_lr 2e-4 over steps 2..10, then 2..20 (tiny.yaml's rates)
    assert lr_at(short, 10) == pytest.approx(2e-4)
    assert lr_at(longer, 10) == pytest.approx(2e-3 - (2e-3 - 2e-4) * 8 / 18)
    assert "jumps from 0.0002 back up to 0.0012" in lr_jump_warning(short, longer, 10)
    assert lr_jump_warning(short, cfg("training.train_iters=20", f"{DECAY}=10"), 10) is None  # the saved schedule
    warming = cfg("training.train_iters=5", "training.lr_warmup_iters=20")
    assert lr_jump_warning(warming, cfg("training.train_iters=10", "training.lr_warmup_iters=20"), 5) is None


@pytest.mark.slow
def test_extended_run_has_the_learning_rates_of_an_uninterrupted_one(cli_run, tmp_path, corpus_cache):
    args = SMALL + ["training.eval_interval=0", f"data.cache_dir={corpus_cache}"]
    whole = cli_run(tmp_path / "whole", *args, "training.train_iters=10")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = cli_run(tmp_path / "extended", *args, "training.train_iters=5")
    assert first.returncode == 0, first.stderr[-3000:]

    reached = _lrs(tmp_path / "extended")[5]  # the first part's last rate: its minimum
    extended = cli_run(tmp_path / "extended", "--resume", "training.train_iters=10")
    assert extended.returncode == 0, extended.stderr[-3000:]
    notes = [line for line in extended.stdout.splitlines() if DECAY in line]
    assert len(notes) == 1 and "5 -> 10" in notes[0], extended.stdout
    assert "lr_decay_iters: 10" in (tmp_path / "extended" / "config.yaml").read_text()
    expected, got = _lrs(tmp_path / "whole"), _lrs(tmp_path / "extended")
    # the rate jumps from the first part's last one to the 10-step schedule's at step 5, as logged
    warnings = [line for line in extended.stderr.splitlines() if line.startswith("dmoe-train: warning:")]
    assert len(warnings) == 1, extended.stderr
    assert f"at step 5, where the run resumes, it jumps from {reached:.2g} back up to {expected[5]:.2g}" in warnings[0]
    assert f"{DECAY}=5" in warnings[0]
    assert [got[step] for step in range(6, 11)] == pytest.approx([expected[step] for step in range(6, 11)], rel=1e-12)


@pytest.mark.slow
def test_a_trial_shorter_than_its_warmup_extends(cli_run, tmp_path, corpus_cache):
    # tiny.yaml's warm-up (20 steps) is longer than the trial
    args = [a for a in SMALL if not a.startswith("training.lr_warmup_iters=")]
    args += ["training.eval_interval=0", f"data.cache_dir={corpus_cache}"]
    trial = cli_run(tmp_path / "trial", *args, "training.train_iters=10")
    assert trial.returncode == 0, trial.stderr[-3000:]
    extended = cli_run(tmp_path / "trial", "--resume", "training.train_iters=12")
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert sorted(_lrs(tmp_path / "trial")) == list(range(1, 13))
