"""A resume that cannot load says which key differs, before anything is built or written."""
from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.training.run_dir import resume_mismatches
from train_helpers import small_args, snapshot


def test_a_changed_model_is_refused_in_one_line_and_the_run_stays_resumable(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    first = cli_run(run, *small_args(corpus_cache, 2))
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run)

    refused = cli_run(run, "model.hidden_size=128", "--resume")
    assert refused.returncode == 2
    message = refused.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "model.hidden_size was 64, now 128" in message
    assert snapshot(run) == before

    # Without its config.yaml the comparison is impossible: the load itself fails, in one line,
    # and still changes nothing.
    config = (run / "config.yaml").read_bytes()
    (run / "config.yaml").unlink()
    unloadable = cli_run(run, *small_args(corpus_cache, 2, "model.hidden_size=128"), "--resume")
    assert unloadable.returncode == 2
    assert len(unloadable.stderr.strip().splitlines()) == 1, unloadable.stderr[-3000:]
    assert "cannot load" in unloadable.stderr and "Traceback" not in unloadable.stderr
    (run / "config.yaml").write_bytes(config)
    assert snapshot(run) == before

    resumed = cli_run(run, "training.train_iters=3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout


def test_schedule_keys_must_match_but_the_length_of_the_run_may_change():
    saved = resolve(load_config(None, ["training.train_iters=20"]))
    assert resume_mismatches(saved, resolve(load_config(None, ["training.train_iters=20", "training.lr_decay_iters=20",
                                                              "logging.log_interval=1"]))) == []
    # lr_decay_iters set by neither run follows train_iters (tests/training/test_extend_run.py)
    longer_from_config = resolve(load_config(None, ["training.train_iters=50"]))
    assert resume_mismatches(saved, longer_from_config) == []
    # a decay length the first run set is part of its schedule
    set_before = resolve(load_config(None, ["training.train_iters=20", "training.lr_decay_iters=20"]))
    assert resume_mismatches(set_before, longer_from_config) == [("training.lr_decay_iters", 20, 50)]
