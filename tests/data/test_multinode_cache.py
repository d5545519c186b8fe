"""Two "nodes" on one machine whose data caches differ (their own XDG_CACHE_HOME): two torchrun
agents of one process each train, the second node building its own index files (megatron-core
builds them on rank 0 only; the second node's rank stopped with FileNotFoundError on
`...document_index.npy`). CPU, gloo.

The agents meet on a store this test holds, on a port the kernel gave it and it keeps (c10d
rendezvous, neither agent its host), and the first agent to join hosts its workers' store on a port
of its own choosing: no port is picked beforehand that another process could take."""
import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_dmoe.config import load_config
from megatron_dmoe.data.builtin import prepare_builtin_corpus
from train_helpers import SMALL

pytestmark = pytest.mark.slow


def _node_cache(corpus_cache, home: Path) -> Path:
    """A cache holding the session's built-in corpus (not retrained) but none of its index files."""
    prepare_builtin_corpus(load_config(None).data.builtin_vocab_size, corpus_cache)
    cache = home / "megatron_dmoe"
    for corpus in (p for p in Path(corpus_cache).glob("builtin-*") if p.is_dir()):
        shutil.copytree(corpus, cache / corpus.name, ignore=shutil.ignore_patterns("index_cache", "*.lock"))
    return cache


def test_nodes_with_their_own_caches_each_build_their_index_files(tmp_path, corpus_cache):
    run_dir = tmp_path / "run"
    rendezvous = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=600))
    args = SMALL + ["training.train_iters=2", "training.lr_warmup_iters=0", "training.eval_interval=0",
                    "checkpoint.save_interval=0"]
    caches, agents = [], []
    for node in (0, 1):
        home = tmp_path / f"node{node}-cache"
        caches.append(_node_cache(corpus_cache, home))
        env = dict(os.environ, XDG_CACHE_HOME=str(home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous.port}",
               "--rdzv-id", "two-nodes", "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1",
               "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-4000:]
    # rank 0's node (the rendezvous orders the nodes) tells that the other does not see its cache
    told = [out for out in outputs if "do not see rank 0's data cache" in out]
    assert len(told) == 1, [out[-3000:] for out in outputs]
    for cache in caches:
        assert list(cache.glob("builtin-*/index_cache/*document_index.npy")), cache
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2
