"""Which ranks write megatron-core's index cache when nodes do not share it.

megatron-core builds a dataset's index files (document, sample and shuffle indices) on global
rank 0, waits at a barrier, and has every other rank read them from the same folder. On a cluster
whose nodes keep that folder on a local disk (XDG_CACHE_HOME or data.cache_dir on /tmp or /scratch)
the other nodes' ranks find nothing there and stop with FileNotFoundError on
`...document_index.npy`.

`index_cache_writer(cfg)`, called on every rank before any data is prepared, finds out whether
each rank sees rank 0's cache folder: rank 0 leaves a marker file there, every rank looks for it
in its own folder. Ranks that see it read what rank 0 writes, as megatron-core intends. Among the
others, the lowest rank of each host (and folder) takes rank 0's part for its node, and the rest
of that node reads from it; `as_index_cache_writer` lets megatron-core's builder see that rank as
rank 0 while it builds (data/cache.py).
"""
from __future__ import annotations

import os
import socket
import uuid

import torch

from megatron_dmoe.data.cache import default_cache_dir
from megatron_dmoe.data.datasets import resolve_blend

_MARKER = ".rank0-of-run-"


def shared_folder(cfg) -> str:
    """The folder whose sharing decides where the index files are built: the built-in corpus's
    cache (data.cache_dir or the user's cache), or the index cache next to (or for read-only data,
    instead of) data.data_path's files."""
    if not cfg.data.data_path:
        return os.path.expanduser(cfg.data.cache_dir) if cfg.data.cache_dir else str(default_cache_dir())
    return resolve_blend(cfg)[1]


def index_cache_writer(cfg) -> bool:
    """Whether this rank writes the index files of its cache folder (a collective: every rank
    calls it, before any rank prepares data). Rank 0 prints one line when some nodes build
    their own."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    rank = dist.get_rank()
    folder = os.path.realpath(shared_folder(cfg))
    marker = None
    if rank == 0:
        marker = _MARKER + uuid.uuid4().hex
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, marker), "w").close()
        except OSError:
            marker = None  # megatron-core reports an unwritable cache when it builds
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (socket.gethostname(), folder, marker))  # rank 0 wrote it before
    marker = places[0][2]
    sees_rank0 = marker is not None and os.path.exists(os.path.join(folder, marker))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sees_rank0)
    if rank == 0 and marker is not None:
        try:
            os.unlink(os.path.join(folder, marker))
        except OSError:
            pass
    apart = [r for r, sees in enumerate(seen) if not sees]
    if rank == 0 and apart:
        hosts = sorted({places[r][0] for r in apart})
        print(f"data: {len(apart)} of {len(seen)} processes ({', '.join(hosts[:3])}"
              f"{' ...' if len(hosts) > 3 else ''}) do not see rank 0's data cache {folder}: each node "
              "builds the index files in its own (set data.cache_dir to a folder all nodes share to "
              "build them once)", flush=True)
    if sees_rank0:
        return rank == 0
    mine = places[rank][:2]
    return rank == min(r for r in apart if places[r][:2] == mine)

