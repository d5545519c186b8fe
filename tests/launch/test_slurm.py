"""scripts/slurm/train.sbatch and `dmoe-sweep --slurm` on a real one-node SLURM cluster (CPU, gloo).

A plain job trains to the end; a job sent the preemption notice (USR1 to the batch script, as
--signal=B:USR1@120 sends it) saves, requeues itself and resumes from its checkpoint to the same
losses; a two-run sweep runs as one job array.
"""
import re
import time
from pathlib import Path

import pytest

from megatron_dmoe.cli import sweep_main
from megatron_dmoe.sweep.status import run_status
from train_helpers import losses

SBATCH = str(Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "train.sbatch")
pytestmark = pytest.mark.slow


def _metrics_lines(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def test_job_trains_and_a_preempted_job_requeues_and_resumes(slurm_cluster, job_env, tmp_path,
                                                           small_run):
    cluster, steps = slurm_cluster, 100
    args = ["tiny", *small_run(steps)]
    plain_dir, preempted_dir = tmp_path / "plain", tmp_path / "preempted"
    plain_out, preempted_out = tmp_path / "plain.out", tmp_path / "preempted.out"
    plain = cluster.sbatch(f"--output={plain_out}", SBATCH, *args,
                           env={**job_env, "RUN_DIR": str(plain_dir)}, cwd=tmp_path)
    preempted = cluster.sbatch(f"--output={preempted_out}", SBATCH, *args,
                               env={**job_env, "RUN_DIR": str(preempted_dir)}, cwd=tmp_path)
    outputs = (plain_out, preempted_out)

    # Training has started (the SIGTERM handler is in place) once a step is logged.
    while _metrics_lines(preempted_dir) < 1:
        # a job that left the queue without a step has failed (a hang is pytest-timeout's to stop)
        queued = cluster.run("squeue", "-h", "-j", preempted, check=False).stdout.strip()
        assert queued, "the job left the queue before a training step\n" + cluster.logs(outputs)
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", "--batch", preempted)
    cluster.wait_until_gone(plain, output=outputs)
    cluster.wait_until_gone(preempted, output=outputs)

    log = preempted_out.read_text()
    stopped = re.search(r"stopping at step (\d+) on SIGTERM", log)
    assert stopped, "the preempted run did not save and stop\n" + cluster.logs(outputs)
    at = int(stopped.group(1))
    assert at < steps
    assert "requeueing job" in log
    assert f"resumed from {preempted_dir}/checkpoints/iter_{at:07d}" in log, log[-3000:]
    info = cluster.job_info(preempted)
    assert "JobState=COMPLETED" in info and "Restarts=1" in info, info
    assert "JobState=COMPLETED" in cluster.job_info(plain), cluster.logs(outputs)

    for run_dir in (plain_dir, preempted_dir):
        status = run_status(run_dir)
        assert status.finished and status.checkpoint_step == steps, status
    one, two = losses(plain_dir), losses(preempted_dir)
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    for step in one:  # resuming continues the same run: same data order, same weights
        assert two[step] == pytest.approx(one[step], rel=1e-6, abs=0), step


def test_sweep_runs_as_one_job_array(slurm_cluster, job_env, tmp_path, small_run, monkeypatch,
                                     capsys):
    cluster = slurm_cluster
    sweep = tmp_path / "sweep.yaml"
    overrides = "".join(f"  {item.replace('=', ': ', 1)}\n" for item in small_run(3)
                        if not item.startswith("moe.top_k="))
    sweep.write_text(f"base: tiny\noverrides:\n{overrides}grid:\n  moe.top_k: [1, 2]\n")
    for key, value in {**cluster.env, **job_env}.items():
        monkeypatch.setenv(key, value)
    runs_dir = tmp_path / "runs"
    assert sweep_main([str(sweep), "--slurm", "--runs-dir", str(runs_dir)]) == 0
    job = re.search(r"submitted job array (\d+)", capsys.readouterr().out).group(1)
    cluster.jobs.append(job)
    outputs = [runs_dir / f"slurm-{job}_{task}.out" for task in (0, 1)]
    cluster.wait_until_gone(job, output=outputs)

    info = cluster.job_info(job)
    for task in (0, 1):
        assert f"ArrayJobId={job} ArrayTaskId={task}" in info, info
    assert info.count("JobState=COMPLETED") == 2, info + cluster.logs(outputs)
    for top_k, out in zip((1, 2), outputs):
        run_dir = runs_dir / f"top_k={top_k}"
        assert f"run directory {run_dir.resolve()}" in out.read_text()
        status = run_status(run_dir)
        assert status.finished and status.checkpoint_step == 3, cluster.logs(outputs)
        assert sorted(losses(run_dir)) == [1, 2, 3]
