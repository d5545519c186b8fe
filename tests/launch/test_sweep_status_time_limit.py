"""A run stopped by training.time_limit_minutes counts as finished for sweeps and SLURM requeueing
once its checkpoint at the stopping step is complete; a run preempted before its budget does not."""
import json

from megatron_dmoe.config import load_config, save_config
from megatron_dmoe.sweep import status as status_module
from megatron_dmoe.sweep.status import run_status


def _run_dir(path, times, latest, limit="0.5", save_interval="null"):
    """Logged steps 1.. with the given train_time_s values; checkpoint `latest` (None: none)."""
    save_config(load_config("tiny", ["training.train_iters=100", f"training.time_limit_minutes={limit}",
                                     f"checkpoint.save_interval={save_interval}"]),
                path / "config.yaml")
    records = [{"step": i + 1, "loss": 3.0, "train_time_s": t} for i, t in enumerate(times)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if latest is not None:
        (path / "checkpoints").mkdir(exist_ok=True)
        (path / "checkpoints" / "latest").write_text(str(latest))


def test_time_limited_run_is_finished_once_saved(tmp_path):
    _run_dir(tmp_path, [10.0, 20.0, 31.0], latest=None)  # budget 30 s spent, final save missing
    assert not run_status(tmp_path).finished
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("3")
    status = run_status(tmp_path)
    assert status.finished
    assert status.describe() == "finished (training.time_limit_minutes=0.5 at step 3 of 100)"
    assert status_module.main([str(tmp_path)]) == 0


def test_preempted_before_the_budget_is_not_finished(tmp_path):
    _run_dir(tmp_path, [10.0, 20.0], latest=2)
    assert not run_status(tmp_path).finished
    assert run_status(tmp_path).describe() == "step 2 of 100"


def test_without_checkpoints_the_logged_time_tells(tmp_path):
    _run_dir(tmp_path, [10.0, 29.0], latest=None, save_interval=0)
    assert not run_status(tmp_path).finished
    _run_dir(tmp_path, [10.0, 29.0, 30.0], latest=None, save_interval=0)
    assert run_status(tmp_path).finished
