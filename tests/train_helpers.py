"""Helpers for tests that run `dmoe-train` end to end in a subprocess (imported via pytest.ini pythonpath)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# A model small enough for a 2-core CPU; the built-in corpus is shared by every test in the session.
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.ffn_hidden_size=128",
    "training.micro_batch_size=4",
    "training.global_batch_size=8",
    "training.lr_warmup_iters=2",
    "logging.log_interval=1",
    "logging.progress_bar=off",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def train_command(run_dir, *args, config=None):
    cmd = [sys.executable, "-m", "megatron_dmoe"]
    if config:
        cmd.append(config)
    return cmd + list(args) + ["--run-dir", str(run_dir)]


def run_train(run_dir, *args, config=None, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        train_command(run_dir, *args, config=config), capture_output=True, text=True, timeout=timeout, env=env
    )


def losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def snapshot(run_dir):
    """{path relative to run_dir: sha256 of its content} for every file under run_dir ({} when
    it does not exist): two snapshots are equal when nothing was added, removed or changed."""
    root = Path(run_dir)
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def small_args(corpus_cache, train_iters, *extra):
    """The SMALL overrides for a quick CPU run of `train_iters` steps, without evaluation or
    warm-up (any number of steps is valid)."""
    return SMALL + [f"training.train_iters={train_iters}", "training.lr_warmup_iters=0",
                    "training.eval_interval=0", f"data.cache_dir={corpus_cache}", *extra]
