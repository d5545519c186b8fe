"""Run a function in N fresh processes joined by one process group: gloo between CPU processes, or
NCCL with one GPU per process.

Processes are spawned (not forked), so none inherits the test process's torch.distributed state.
Each gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK = RANK, MASTER_ADDR/PORT), joins the
default group through a store this process hosts (as torchrun's agent does) with
`init_distributed(device)` and runs `fn(*args)`; `fn` re-initialises megatron's groups with its own
sizes through `init_distributed(device, ...)`. An exception in any process fails the caller with
that process's traceback.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off: a program that uses it can take a shared host's GPUs out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Every new_group ends in a store barrier over all ranks (torch's switch; off by default). Without it
# a rank leaves new_group once its own gloo pairs are connected: an initiating pair counts once its
# sequence number is written, before the peer has taken the connection. A fast rank that then
# rebuilds megatron's groups (init_distributed destroys the previous gloo groups) closes sockets a
# slower rank is still connecting: "Gloo connectFullMesh failed ... Connection closed by peer" there.
# megatron's groups are built twice in a row here (below, then in `fn`); init_distributed waits for
# every rank before a rebuild too, and this covers any other teardown that follows a group's creation.
INIT_BARRIER_ENV = {"TORCH_DIST_INIT_BARRIER": "1"}


# The ranks join the store the parent hosts (torchrun's agent store) instead of rank 0 opening one
# on a port picked beforehand: another process (a concurrent test run's gloo pairs) could take a
# picked port before rank 0 listens on it (EADDRINUSE). The parent binds port 0 and keeps it.
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def _entry(rank, world_size, port, device, fn, args):
    torch.set_num_threads(1)  # several processes share two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), **NCCL_ENV, **INIT_BARRIER_ENV, **AGENT_STORE_ENV)
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed

    init_distributed(device)  # on CUDA: GPU LOCAL_RANK, NCCL
    fn(*args)  # an exception ends this process at once; the parent then stops the others
    destroy_distributed()
    # Success: leave without interpreter finalisation, which takes seconds per process with torch
    # and megatron loaded (failures return normally, so the parent receives the traceback).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_processes(world_size: int, fn, *args, timeout: float = 300.0, device: str = "cpu") -> dist.TCPStore:
    """fn must be importable by name (defined at module level in this folder's helper modules).
    Returns the store the ranks met on (what they wrote there stays readable).

    device: 'cpu' (gloo) or 'cuda' (NCCL; needs `world_size` GPUs). A deadlock (a collective some
    rank never joins) fails after `timeout` seconds instead of hanging.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    context = mp.start_processes(_entry, args=(world_size, store.port, device, fn, args), nprocs=world_size,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} processes running {fn.__name__} did not finish in {timeout:.0f} s")
    return store
