"""Our own writer class and results queue inside megatron-core's torch_dist save.

megatron-core (0.16 through 0.19, checked: 0.16.1, 0.19.1) offers no argument for either: its
torch_dist save strategy instantiates `FileSystemWriterAsync` by name (0.16 from the strategy
module, where it was imported; 0.19 from filesystem_async, at each save: mcore.py finds the homes),
and the writer gets its results queue from a module-level factory that starts a
`multiprocessing` Manager. training/checkpoint_writer.py, which writes with threads of the
training process instead, replaces both for the length of one call. Could go once upstream takes a
writer class (or factory) in the save strategy and a results queue in the writer.
"""
from __future__ import annotations

import contextlib
import queue
from typing import Iterator

from megatron_dmoe.compat import mcore as mcore_compat
from megatron_dmoe.compat.patching import patched, patched_in


def _plain_queue(*args, **kwargs) -> queue.Queue:
    return queue.Queue()


@contextlib.contextmanager
def writer_class(cls) -> Iterator[None]:
    """The torch_dist save strategy instantiates `cls` instead of FileSystemWriterAsync in the block."""
    with patched_in(mcore_compat.checkpoint_writer_homes(), "FileSystemWriterAsync", cls):
        yield


@contextlib.contextmanager
def in_process_results_queue() -> Iterator[None]:
    """The writer's results travel in a plain queue within this process (not a Manager's) in the block."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with patched(filesystem_async, mcore_compat.write_results_queue_name(), _plain_queue):
        yield
