"""A deterministic, resumable micro-batch iterator over a map-style dataset.

Micro-step j after a resume at `consumed_samples` covers the global sample positions
[consumed_samples + j*G, consumed_samples + (j+1)*G) with G = micro_batch_size * dp_size, and data
parallel rank r takes the contiguous slice [r*mbs, (r+1)*mbs) of them, as Megatron-LM's pretraining
sampler does. Batches are a pure function of the sample position, so resuming at consumed_samples
replays exactly what an uninterrupted run would have seen. Past the end of the dataset, positions
wrap around: epoch 0 keeps the dataset's order (megatron-core's GPTDataset is already shuffled),
each later epoch is a fresh permutation drawn from `seed` and the epoch number.
"""
from __future__ import annotations

import signal
import weakref
from typing import Dict, Iterator, List

import numpy as np
import torch
from torch.utils.data import DataLoader

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class MicroBatchSampler:
    """Yields, forever, the dataset indices of this rank's micro-batches."""

    def __init__(self, dataset_size: int, micro_batch_size: int, consumed_samples: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        if dataset_size <= 0:
            raise ValueError("the dataset is empty: there is nothing to load")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must lie in [0, dp_size), got {dp_rank} of {dp_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.size = dataset_size
        self.mbs = micro_batch_size
        self.consumed = consumed_samples
        self.rank = dp_rank
        self.dp = dp_size
        self.seed = seed
        self._epoch = 0
        self._order = None  # the permutation of self._epoch (None: identity)

    def index(self, position: int) -> int:
        """The dataset index at a global sample position."""
        epoch, offset = divmod(position, self.size)
        if epoch == 0:
            return offset
        if epoch != self._epoch:
            rng = np.random.RandomState((self.seed + epoch) % 2**32)
            self._order = rng.permutation(self.size)
            self._epoch = epoch
        return int(self._order[offset])

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed + self.rank * self.mbs
        step = self.mbs * self.dp
        while True:
            yield [self.index(p) for p in range(start, start + self.mbs)]
            start += step


def _collate(samples: List[Dict]) -> Dict[str, torch.Tensor]:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in BATCH_KEYS}


def _ignore_termination(worker_id: int) -> None:
    """Workers leave SIGTERM and SIGINT to the training process: schedulers and torchrun signal the
    whole process group on preemption, a terminal's Ctrl-C reaches the whole foreground group, and
    a worker dying first would crash the run before it saves."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class MicroBatchLoader:
    """An endless iterator of micro-batches whose worker processes stop on `close()`.

    Workers ignore SIGTERM and SIGINT (see `_ignore_termination`), so multiprocessing's exit handler, which
    sends SIGTERM to daemonic children and then joins them, would wait on them forever if a loader
    were still open when the interpreter exits. `close()` shuts them down; so does a finalizer that
    runs when the loader is collected or, at the latest, at exit before multiprocessing's handler.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._batches = iter(loader)
        self._close = weakref.finalize(self, _shutdown_workers, self._batches)

    def __iter__(self) -> "MicroBatchLoader":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        if not self._close.alive:
            raise RuntimeError("this micro-batch loader is closed; build a new one with build_loader")
        return next(self._batches)

    def close(self) -> None:
        self._close()

    def __enter__(self) -> "MicroBatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown_workers(batches) -> None:
    # Only the multi-process iterator has workers; DataLoader exposes no public call for this.
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def build_loader(dataset, micro_batch_size: int, consumed_samples: int, dp_rank: int,
                 dp_size: int, num_workers: int, seed: int) -> MicroBatchLoader:
    """An endless iterator of micro-batches: dicts of `tokens`, `labels`, `position_ids` (long)
    and `loss_mask` (float), each [micro_batch_size, seq_length]. Close it when done."""
    sampler = MicroBatchSampler(len(dataset), micro_batch_size, consumed_samples,
                                dp_rank, dp_size, seed)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate,
        worker_init_fn=_ignore_termination if num_workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
    )
    return MicroBatchLoader(loader)
