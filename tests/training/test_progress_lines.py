"""The console's progress lines say what happens: a run stopped between evaluations names the step
its validation loss is from; resuming a run with nothing left to train says so (and why) instead of
announcing steps it will not take."""
from train_helpers import small_args


class _StopAtThirdStep:
    """PreemptionWatcher as if Ctrl-C came during step 3."""

    def __init__(self, device):
        self.calls = 0

    def should_stop(self):
        self.calls += 1
        return "SIGINT" if self.calls == 3 else None

    def close(self):
        pass


def test_stop_and_resume_lines(cli_run, tmp_path, corpus_cache, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr("megatron_dmoe.training.loop.PreemptionWatcher", _StopAtThirdStep)
        stopped = cli_run(run, *small_args(corpus_cache, 6, "training.eval_interval=2",
                                           "training.eval_iters=1"))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    summary = stopped.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"run directory: {run} (step 3, validation loss "), summary
    assert summary.endswith(" at step 2)"), summary  # the loss is step 2's evaluation, not step 3's

    finished = cli_run(run, "training.train_iters=3", "--resume")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "training.train_iters=3 was reached at step 3: nothing left to train; raise it" in finished.stdout
    assert "training: steps" not in finished.stdout, finished.stdout

    out_of_time = cli_run(run, "training.train_iters=6", "training.time_limit_minutes=1e-9", "--resume")
    assert out_of_time.returncode == 0, out_of_time.stderr[-3000:]
    assert "training.time_limit_minutes=1e-09 was spent at step 3: nothing left to train" in out_of_time.stdout
    assert "training: steps" not in out_of_time.stdout, out_of_time.stdout
