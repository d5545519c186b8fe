"""Rendezvous without a picked port. A port picked by binding port 0 and closing it comes from the
kernel's ephemeral range, where another process's connection may take it before the store listens
(EADDRINUSE): a plain single process needs no port at all, and the test harness holds the one its
ranks meet on."""
import os
import subprocess
import sys

import torch.distributed as dist

from process_group import run_in_processes

_SINGLE = """
import os
import torch.distributed as dist
from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed

init_distributed("cpu")
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
assert isinstance(store, dist.HashStore), type(store)
assert not {"MASTER_ADDR", "MASTER_PORT"} & set(os.environ), "the launch environment was written"
destroy_distributed()
"""


def test_a_plain_single_process_rendezvous_in_process():
    launch = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {key: value for key, value in os.environ.items() if key not in launch}
    proc = subprocess.run([sys.executable, "-c", _SINGLE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _sign_the_default_store() -> None:
    """Each rank writes its rank, under a key of its own, to the store its default group met on."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # the default group's prefix
        store = store.underlying_store
    store.set(f"signed/{dist.get_rank()}", str(dist.get_rank()))
    dist.barrier()


def test_the_harness_ranks_meet_on_a_store_the_parent_holds():
    store = run_in_processes(2, _sign_the_default_store, timeout=120)
    keys = [f"signed/{rank}" for rank in range(2)]
    assert store.check(keys), "the ranks met on another store than the one the harness holds"
    assert [store.get(key) for key in keys] == [b"0", b"1"]
