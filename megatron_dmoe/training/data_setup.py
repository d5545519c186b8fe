"""Tokenizer and datasets of a run, checked before any model is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_dmoe.config import RunConfig
from megatron_dmoe.data import build_datasets, build_tokenizer
from megatron_dmoe.parallel.distributed import DistEnv


@dataclass
class RunData:
    tokenizer: Any
    vocab_size: int  # of the model, before padding
    train: Any
    valid: Any


def prepare_run_data(cfg: RunConfig, env: DistEnv) -> RunData:
    """Build the tokenizer and the train/valid datasets; raises DataError on bad input.

    Rank 0 goes first so the built-in corpus and megatron's index caches are made once; the other
    ranks then find them ready.
    """
    if not env.is_main:
        dist.barrier()
    tokenizer = build_tokenizer(cfg)
    tr = cfg.training
    # Every evaluation reads the same first eval_iters batches, so validation curves compare
    # like with like and a resumed run evaluates exactly as an uninterrupted one.
    valid_samples = tr.eval_iters * tr.global_batch_size if tr.eval_interval else 0
    train, valid, _ = build_datasets(
        cfg,
        tokenizer,
        (tr.train_iters * tr.global_batch_size, valid_samples, 0),
        is_built_on_rank=lambda: True,
    )
    if env.is_main:
        dist.barrier()
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    return RunData(tokenizer=tokenizer, vocab_size=vocab_size, train=train, valid=valid)


def run_loader(cfg: RunConfig, dataset, consumed_samples: int = 0):
    """The micro-batch loader training reads `dataset` with (this rank's share, the run's seed)."""
    from megatron.core import parallel_state as ps

    from megatron_dmoe.data import build_loader

    return build_loader(
        dataset,
        micro_batch_size=cfg.training.micro_batch_size,
        consumed_samples=consumed_samples,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        num_workers=cfg.data.num_workers,
        seed=cfg.training.seed,
    )
