"""Where prepared data lives by default (the built-in corpus and staged tokenizer folders), and the
lock that keeps concurrent runs from reading megatron-core's index cache while another writes it."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
