"""Loss and perplexity of a loaded run over its own validation split or over indexed datasets.

Both go through training's `evaluate` (training/step.py): the mean over micro-batches of each
micro-batch's mean token loss, averaged over data-parallel ranks. On the run's validation split with
the run's batch sizes that is exactly the computation behind metrics.jsonl's val_loss.
"""
from __future__ import annotations

import copy
import math
from typing import List, Optional

from megatron.core import parallel_state as ps

from megatron_dmoe.inference.errors import UsageError
from megatron_dmoe.inference.run_model import LoadedRun


def _progress(loader, total: int, enabled: bool):
    """A bar on stderr only when stderr is a terminal: redirected into a log, its redraws are noise."""
    import sys

    from tqdm import tqdm

    enabled = enabled and sys.stderr.isatty()
    return iter(tqdm(loader, total=total, desc="evaluating", unit="batch", disable=not enabled, leave=False))


def check_data_path(prefixes: List[str]) -> None:
    """Prefixes without weights whose .bin/.idx files exist; UsageError otherwise (cheap: run it first)."""
    import os

    from megatron_dmoe.data import DataError, check_data_files, parse_blend

    try:
        if parse_blend(prefixes)[1] is not None:
            raise UsageError(f"--data-path {' '.join(prefixes)}: give dataset prefixes without weights; "
                             "every document is read once")
        check_data_files([os.path.abspath(os.path.expanduser(p)) for p in prefixes])
    except DataError as err:
        raise UsageError("--data-path: " + " ".join(line.strip() for line in str(err).splitlines())) from None


def _dataset_over(run: LoadedRun, prefixes: List[str]):
    """One pass over every document of `prefixes` (megatron's GPTDataset, the run's sequence length)."""
    from megatron_dmoe.data import DataError, build_datasets

    check_data_path(prefixes)
    cfg = copy.deepcopy(run.cfg)
    cfg.data.data_path = list(prefixes)
    cfg.data.split = "100,0,0"
    cfg.data.tokenizer_model = run.tokenizer.path
    try:
        dataset, _, _ = build_datasets(cfg, run.tokenizer, (None, 0, 0))
    except DataError as err:
        raise UsageError(f"--data-path: {err}") from None
    return dataset


def evaluate_run(run: LoadedRun, data_path: Optional[List[str]] = None, progress: bool = True) -> dict:
    """{"loss", "perplexity", "tokens", "micro_batches", ...} of the run's model.

    Without data_path: the run's validation split exactly as training built and read it (its
    eval_iters global batches). With data_path: every full micro-batch group of one pass over the
    datasets (the last, partial one, fewer than micro_batch_size x data-parallel samples, is left out).
    """
    from megatron_dmoe.training.setup import run_loader
    from megatron_dmoe.training.step import evaluate

    cfg = run.cfg
    tr = cfg.training
    dp = ps.get_data_parallel_world_size()
    per_step = tr.micro_batch_size * dp
    if data_path:
        dataset = _dataset_over(run, data_path)
        source = {"data_path": list(data_path), "samples": len(dataset)}
        micro_batches = len(dataset) // per_step
        if micro_batches == 0:
            raise UsageError(f"--data-path holds {len(dataset)} sequences of {cfg.model.seq_length} tokens, fewer "
                             f"than one micro-batch on every rank ({per_step}); give more data or a smaller "
                             "--micro-batch-size")
        batches, groups = 1, micro_batches
    else:
        if run.data is None or run.data.valid is None or not tr.eval_interval:
            raise UsageError("the run has no validation split (training.eval_interval is 0 or data.split "
                             "gives validation no share); pass --data-path")
        dataset = run.data.valid
        source = {"split": "validation"}
        if tr.global_batch_size % per_step:
            raise UsageError(f"training.global_batch_size={tr.global_batch_size} is not a multiple of "
                             f"micro_batch_size x data-parallel size = {per_step}")
        batches, groups = tr.eval_iters, tr.global_batch_size // per_step
    with run_loader(cfg, dataset, 0) as loader:
        data = _progress(loader, batches * groups, progress and run.env.is_main)
        loss = evaluate(run.model, data, batches, groups, run.env.device)
    run.model.eval()  # evaluate() hands the model back in training mode
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "tokens": batches * groups * per_step * cfg.model.seq_length,
        "micro_batches": batches * groups * dp,  # over all data-parallel ranks
        "checkpoint_iteration": run.iteration,
        **source,
    }
