"""torchrun with 2 data-parallel CPU processes (gloo) trains like one process with the same global batch."""
import os
import subprocess
import sys

from train_helpers import SMALL, losses


def test_two_process_data_parallel_matches_one_process(cli_run, tmp_path, corpus_cache):
    args = SMALL + ["training.train_iters=6", "training.eval_interval=3", "training.eval_iters=1",
                    "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}"]
    single = cli_run(tmp_path / "single", *args)  # one process: this one
    assert single.returncode == 0, single.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "megatron_dmoe", *args, "--run-dir", str(tmp_path / "dp2")]
    dp = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert dp.returncode == 0, dp.stderr[-3000:]
    one, two = losses(tmp_path / "single"), losses(tmp_path / "dp2")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        # same samples, same weights: only the reduction order of the gradient differs
        assert abs(one[step] - two[step]) <= 1e-4 * abs(one[step]), (step, one[step], two[step])
