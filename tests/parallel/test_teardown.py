"""Teardown, in 2 processes (one spawn for both checks): a finished run frees its model and groups;
after a failure the process groups are aborted, not destroyed gracefully (a graceful NCCL teardown
waits for peers stuck in a collective the failed rank will never join), and nothing stays
initialised. Gloo cannot show the hang itself; this checks the abort path."""
from process_group import run_in_processes


def _abort_after_failure() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed

    init_distributed("cpu", expert_model_parallel_size=2)
    destroy_distributed(abort=True)
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


def _train_twice_and_count_models(run_root: str, cache_dir: str) -> None:
    import gc
    from pathlib import Path

    from layout_checks import KINDS, MODEL
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import GPTModelWithFusedLoss
    from megatron_dmoe.parallel.distributed import init_distributed
    from megatron_dmoe.training.loop import train

    overrides = MODEL + KINDS["moe"] + ["parallel.expert_model_parallel_size=2", "training.global_batch_size=4",
                                        "training.use_distributed_optimizer=true", f"data.cache_dir={cache_dir}"]
    cfg = resolve(load_config(None, overrides))
    for run in ("first", "second"):
        env = init_distributed("cpu", expert_model_parallel_size=2)
        train(cfg, env, Path(run_root) / run, resume=False)
        gc.collect()
        alive = [obj for obj in gc.get_objects() if isinstance(obj, GPTModelWithFusedLoss)]
        assert not alive, f"after the {run} run {len(alive)} model(s) are still alive"


def _train_twice_then_abort(run_root: str, cache_dir: str) -> None:
    _train_twice_and_count_models(run_root, cache_dir)
    _abort_after_failure()


def test_a_finished_run_frees_its_model_and_groups_and_an_abort_leaves_none(tmp_path, corpus_cache):
    """A process that trains run after run (a sweep, a test of every layout) keeps none of a finished
    run's model, optimizer or process groups: megatron's gradient hooks and the distributed
    optimizer's parameter shards close reference cycles through autograd's C++ nodes, which the
    garbage collector cannot free, and each gloo group they held kept three threads. Then the same
    processes abort their groups as after a failure, and nothing stays initialised."""
    run_in_processes(2, _train_twice_then_abort, str(tmp_path / "runs"), corpus_cache, timeout=600)
