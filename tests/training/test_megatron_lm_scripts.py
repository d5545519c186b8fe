"""Megatron-LM's Mixtral example script, its flags unchanged but for the sizes and the data flags
(tests/megatron_lm_scripts.py), trains 3 steps on a CPU in one process (EP 1) and under torchrun in
two (EP 2), writing its checkpoint to --save and its TensorBoard events to --tensorboard-dir; the
same command launched again continues from that checkpoint (--load names the same directory). The
MoE guide's arguments, on the Mixtral script's model flags, train too."""
import json
import os
import subprocess
import sys

from megatron_lm_scripts import MIXTRAL_MODEL, MIXTRAL_TRAINING, MOE_GUIDE, mixtral


def _records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _check_run(ckpt, steps):
    records = _records(ckpt)
    assert sorted(records) == steps
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 20 for r in records.values())
    assert (ckpt / "checkpoints" / "latest").read_text().strip() == str(steps[-1])
    assert list((ckpt / "tensorboard").glob("events.out.tfevents.*"))
    saved = (ckpt / "config.yaml").read_text()
    assert "overlap_grad_reduce: true" in saved and "use_distributed_optimizer: true" in saved
    return records


def test_mixtral_script_trains_on_cpu_and_continues(cli_run, tmp_path, corpus_cache):
    ckpt = tmp_path / "mixtral"
    data = f"data.cache_dir={corpus_cache}"  # the data: the built-in corpus, cached for the session
    first = cli_run(None, *mixtral(ckpt), data)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "dmoe-train: error" not in first.stderr
    _check_run(ckpt, [1, 2, 3])
    # the script launched again with one more step: continues at step 4 (fresh optimizer and RNG, as
    # --no-load-optim --no-load-rng ask)
    again = cli_run(None, *mixtral(ckpt), data, "--train-iters", "4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt / 'checkpoints' / 'iter_0000003'}" in again.stdout
    _check_run(ckpt, [1, 2, 3, 4])


def test_mixtral_script_trains_under_torchrun_at_ep2(tmp_path, corpus_cache):
    ckpt = tmp_path / "mixtral"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "megatron_dmoe", *mixtral(ckpt, ep=2), f"data.cache_dir={corpus_cache}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    _check_run(ckpt, [1, 2, 3])
    assert "parallel:\n" in (ckpt / "config.yaml").read_text()
    assert "expert_model_parallel_size: 2" in (ckpt / "config.yaml").read_text()


def test_moe_guide_arguments_train_on_cpu(cli_run, tmp_path, corpus_cache):
    """The MoE guide's arguments with DeepSeek-style routing (sigmoid scores, expert bias, groups,
    a shared expert, a dense first layer, the sequence-wise loss) on the Mixtral script's model."""
    ckpt = tmp_path / "guide"
    done = cli_run(None, *MIXTRAL_MODEL, *MOE_GUIDE, *MIXTRAL_TRAINING, "--save", str(ckpt), "--log-interval", "1",
                   f"data.cache_dir={corpus_cache}")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(ckpt)
    assert sorted(records) == [1, 2, 3]
    assert all(len(r["expert_load"]) == 1 for r in records.values())  # layer 1 dense, layer 2 MoE
    saved = (ckpt / "config.yaml").read_text()
    assert "aux_loss_type: sequence" in saved and "router_num_groups: 4" in saved
