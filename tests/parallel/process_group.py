"""Run a function in N fresh CPU processes joined by a gloo process group.

Processes are spawned (not forked), so none inherits the test process's torch.distributed state.
Each runs `fn(*args)` with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) set, so
`init_distributed("cpu", ...)` joins them into one gloo group; an exception in any process fails
the caller with that process's traceback.
"""
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args):
    torch.set_num_threads(1)  # several processes share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from megatron_dmoe.parallel.distributed import destroy_distributed

    fn(*args)  # an exception ends this process at once; the parent then stops the others
    destroy_distributed()
    # Success: leave without interpreter finalisation, which takes seconds per process with torch
    # and megatron loaded (failures return normally, so the parent receives the traceback).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_processes(world_size: int, fn, *args, timeout: float = 300.0) -> None:
    """fn must be importable by name (defined at module level in this folder's helper modules).

    A deadlock (a collective some rank never joins) fails after `timeout` seconds instead of hanging.
    """
    context = mp.start_processes(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} processes running {fn.__name__} did not finish in {timeout:.0f} s")
