"""Shared test setup: GPU tests skip without CUDA, so the CPU suite runs anywhere.

Without CUDA, Triton kernels run through Triton's interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated, so it is set here, before any test module (or megatron-core) imports triton.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from lanes import lane_marks

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in lane_marks(item.path, item.fixturenames):
            item.add_marker(name)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def cpu_dist():
    """A one-process gloo group with megatron's model-parallel groups (sizes 1), seeded; torn down
    afterwards: every gloo group keeps three threads alive until it is destroyed, and groups left
    behind by one test after another slowed the whole suite (2,400 threads, some spinning)."""
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything

    env = init_distributed("cpu")
    seed_everything(1234, env)
    yield env
    destroy_distributed()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One built-in corpus cache for every end-to-end run of the session."""
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def cli_run(capsys):
    """cli_run(run_dir, *args): dmoe-train in this process (no interpreter start-up per call);
    returns returncode, stdout and stderr. run_dir None leaves --run-dir out."""
    from megatron_dmoe.cli import train_main

    def run(run_dir, *args):
        argv = list(args) + (["--run-dir", str(run_dir)] if run_dir is not None else [])
        code = train_main(argv)
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run
