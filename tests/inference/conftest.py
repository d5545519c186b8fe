"""Tiny trained runs shared by the after-training tests: one dense GPT (GPT-2 shaped) and one
Mixtral-shaped dMoE, trained in one process, and the same dMoE trained at expert parallelism 2 in
two processes (gloo). They train at the same time, once per session."""
import os
import subprocess
import sys

import pytest

from train_helpers import train_command

COMMON = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "model.init_method_std=0.05",  # varied greedy continuations after two steps
    "training.micro_batch_size=4",
    "training.global_batch_size=8",
    "training.train_iters=2",
    "training.lr_warmup_iters=1",
    "training.eval_interval=2",
    "training.eval_iters=2",
    "logging.log_interval=1",
    "logging.progress_bar=off",
    "logging.tensorboard=false",
    "logging.plot=false",
]
DENSE = ["moe.num_experts=0"]
MIXTRAL = [
    "model.activation=swiglu",
    "model.normalization=RMSNorm",
    "model.position_embedding_type=rope",
    "model.rotary_base=500",
    "model.add_bias_linear=false",
    "model.untie_embeddings_and_output_weights=true",
    "model.num_query_groups=2",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.ffn_hidden_size=64",
    "moe.router_renormalize=true",
]


def _launch(run_dir, args, nproc=1):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = train_command(run_dir, *args)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def make_untrained_run(run_dir, overrides):
    """A run directory as dmoe-train leaves it (config.yaml, a checkpoint at step 2), written in this
    process from the model's initial weights: no training, no subprocess."""
    from megatron_dmoe.config import load_config, resolve, save_config
    from megatron_dmoe.data import build_tokenizer
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything
    from megatron_dmoe.training.checkpoint import Progress, save_checkpoint
    from megatron_dmoe.training.run_dir import checkpoint_root

    cfg = resolve(load_config(None, overrides))
    save_config(cfg, run_dir / "config.yaml", versions={})
    env = init_distributed("cpu")
    try:
        seed_everything(cfg.training.seed, env)
        model = build_gpt_model(cfg, vocab_size=build_tokenizer(cfg).vocab_size, on_cuda=False)
        save_checkpoint(checkpoint_root(run_dir), [model], None, None, Progress(iteration=2), keep_last=2)
    finally:
        destroy_distributed()


@pytest.fixture(scope="session")
def runs(tmp_path_factory, corpus_cache):
    """{"dense", "mixtral", "mixtral_ep2"}: run directories with a checkpoint at step 2.

    dense is written here from initial weights; the two dMoE runs train two steps, one in one
    process and one at expert parallelism 2 in two, at the same time (the built-in corpus is
    prepared once, under its lock, by whichever gets there first)."""
    root = tmp_path_factory.mktemp("runs")
    data = [f"data.cache_dir={corpus_cache}"]
    procs = {
        "mixtral": _launch(root / "mixtral", COMMON + MIXTRAL + data),
        "mixtral_ep2": _launch(root / "mixtral_ep2", COMMON + MIXTRAL + data
                               + ["parallel.expert_model_parallel_size=2"], nproc=2),
    }
    make_untrained_run(root / "dense", COMMON + DENSE + data)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, out[-3000:])
    return {name: root / name for name in ("dense", "mixtral", "mixtral_ep2")}


@pytest.fixture(scope="session")
def exported(runs, tmp_path_factory):
    """The runs exported with dmoe-export (in this process)."""
    from megatron_dmoe.export.cli import export_main

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, run_dir in runs.items():
        assert export_main([str(run_dir), str(root / name)]) == 0
        out[name] = root / name
    return out
