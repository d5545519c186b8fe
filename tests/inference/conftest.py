"""Tiny trained runs shared by the after-training tests: one dense GPT (GPT-2 shaped) and one
Mixtral-shaped dMoE, trained in one process, and the same dMoE trained at expert parallelism 2 in
two processes (gloo). They train at the same time, once per session."""
import os
import subprocess
import sys

import pytest

from train_helpers import train_command

# importlib import mode: this folder's helper module is imported by name
if os.path.dirname(__file__) not in sys.path:
    sys.path.insert(0, os.path.dirname(__file__))

from inference_runs import COMMON, DENSE, MIXTRAL, make_untrained_run  # noqa: E402


def _launch(run_dir, args, nproc=1):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = train_command(run_dir, *args)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


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


@pytest.fixture(scope="module")
def corpus(corpus_cache):
    """(data prefix, tokenizer) of the built-in corpus with a 4096-token vocabulary: the HF import
    tests' tokenizer and evaluation data."""
    from megatron_dmoe.data.builtin import prepare_builtin_corpus
    from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

    prefix, model = prepare_builtin_corpus(4096, corpus_cache)
    return prefix, load_tokenizer(model)
