"""dist_checkpointing's torch_dist save, written by threads of the training process itself.

megatron-core's writer (FileSystemWriterAsync) forks one process per file and, on first use, starts
a `multiprocessing` Manager server (a spawned interpreter, plus multiprocessing's resource
tracker) to carry the write results back. The Manager stays for the rest of the process and
nothing ties it to its parent: a training process killed with SIGKILL leaves it, and the tracker,
running. Here the same buckets are written by threads of the training process (file writes release
the GIL), with the same files and results, so no process outlives a run however it ends.
megatron-core takes neither the writer class nor the results queue as an argument: both are
swapped in for the length of a save by compat/torch_dist_save.py.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import List

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron_dmoe.compat.torch_dist_save import in_process_results_queue, writer_class


def _write_buckets(transform_list: List, rank: int, write_buckets: List, results_queue) -> None:
    """megatron's write_preloaded_data_multiproc, with threads instead of forked processes."""
    local_results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()  # write_preloaded_data takes one item off it when finished
    for i in range(len(write_buckets)):
        done.put(i)
    write = partial(FileSystemWriterAsync.write_preloaded_data, transform_list,
                    results_queue=local_results, count_queue=done, use_fsync=True)
    with ThreadPoolExecutor(max_workers=len(write_buckets)) as pool:
        list(pool.map(lambda item: write(local_proc_idx=item[0], write_bucket=item[1]),
                      enumerate(write_buckets)))
    results = {}
    while not local_results.empty():
        index, result = local_results.get()
        if isinstance(result, Exception):
            results_queue.put(result)  # megatron re-raises it on every rank
            return
        results[index] = result
    results_queue.put(results)


class InProcessWriter(FileSystemWriterAsync):
    def prepare_write_data(self, plan, planner) -> None:
        # The results travel within this process: a plain queue instead of the Manager's.
        with in_process_results_queue():
            super().prepare_write_data(plan, planner)

    def get_save_function_and_args(self):
        save_fn, preload_fn, args = super().get_save_function_and_args()
        if save_fn is None:
            return save_fn, preload_fn, args
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        return partial(_write_buckets, transforms), preload_fn, args


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's default torch_dist save strategy, writing through InProcessWriter."""

    def __init__(self):
        super().__init__("torch_dist", 1)

    def async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        with writer_class(InProcessWriter):  # compat/torch_dist_save.py: megatron-core takes no argument for it
            return super().async_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
