"""Where prepared data lives by default (the built-in corpus and staged tokenizer folders), the
lock that keeps concurrent runs from reading megatron-core's index cache while another writes it,
and the rank that writes it in a node that does not share rank 0's (data/cache_sharing.py)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no lock (megatron-core's data path targets Linux)
    fcntl = None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_dmoe"


@contextmanager
def index_cache_lock(cache_dir: str, writer: bool) -> Iterator[None]:
    """Hold an exclusive lock on the index-cache folder while `writer` (the process that writes
    megatron-core's index files: rank 0 of its run) builds datasets.

    Runs started together on the same data (a sweep's runs on one machine) would otherwise write and
    read the same index files at once: megatron-core writes them in place, without a lock, and a
    run reading a half-written file fails at startup. Other ranks of a run wait at megatron-core's
    own barrier, so only writers take the lock (a lock on every rank could deadlock there)."""
    if not writer or fcntl is None:
        yield
        return
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def as_index_cache_writer(writer: bool) -> Iterator[None]:
    """megatron-core's dataset builder and datasets write the index cache on `get_rank() == 0`:
    while this block runs, a writer other than rank 0 answers 0 (its barriers are unchanged,
    so it builds before them, as rank 0 does, and its node's other ranks read after them)."""
    dist = torch.distributed
    if not writer or not dist.is_initialized() or dist.get_rank() == 0:
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0 if group is None else original(group)
    try:
        yield
    finally:
        dist.get_rank = original
