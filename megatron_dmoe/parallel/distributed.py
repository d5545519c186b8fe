"""Start torch.distributed and megatron-core's process groups for one run.

Works the same under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment) and
as a plain single process (a private rendezvous on a free local port). CPU runs use gloo and get
megatron-core's CUDA assumptions redirected (compat/cpu/); CUDA runs use NCCL.
"""
from __future__ import annotations

import gc
import os
import random
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def barrier(group=None) -> None:
    """dist.barrier; under NCCL on this process's current GPU, which torch would otherwise guess
    from the rank, warning twice (a Python UserWarning and a C++ log line) at every call."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def ranks_per_host(world_size: int) -> int:
    """Processes on this host: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks per node ("4" or
    "4(x2)"), else all of them (one host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        return int(local)
    match = re.match(r"\d+", os.environ.get("SLURM_NTASKS_PER_NODE", ""))
    return int(match.group()) if match else world_size


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int  # processes on this host

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(preference: str) -> str:
    """'auto' picks CUDA when torch sees a GPU."""
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return preference


def init_distributed(
    device: str = "auto",
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    timeout_minutes: int = 30,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> DistEnv:
    """Initialise (or re-use) the default process group, then megatron's model-parallel groups."""
    import datetime

    device = resolve_device(device)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        from megatron_dmoe.compat.cpu import leave_host

        leave_host()  # a CPU run earlier in this process left its patches: they pass through now
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        from megatron_dmoe.compat.cpu import apply_cpu_compat

        apply_cpu_compat()
        torch_device = torch.device("cpu")

    if not dist.is_initialized():
        # A plain single process gets an in-process store: no port to pick, so none another
        # process could take first, and no launch variables written for child processes to inherit.
        private = "MASTER_ADDR" not in os.environ and world_size == 1
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            store=dist.HashStore() if private else None,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            # one process: its GPU bound to the group, so that barriers anywhere (megatron-core's
            # checkpointing too) use it instead of guessing one from the rank, with a warning at
            # every call. Not for several: a bound group creates every NCCL group's communicator
            # eagerly, and our own barriers name the GPU (barrier below)
            device_id=torch_device if device == "cuda" and world_size == 1 else None,
        )
    elif ps.model_parallel_is_initialized():
        # the groups are built again: no rank may tear the old gloo groups down while a slower rank
        # is still connecting their pairs (gloo then fails there, "Connection closed by peer")
        barrier()
    _forget_group_state()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        # megatron's default (None) is the tensor-parallel size; our experts are whole (1) unless asked
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    world = dist.get_world_size()
    return DistEnv(rank=dist.get_rank(), world_size=world, local_rank=local_rank, device=torch_device,
                   local_world_size=ranks_per_host(world))


def _forget_group_state() -> None:
    """Drop megatron's process groups. Its destroy_model_parallel destroys only its *_GLOO groups and
    forgets the others, which stay registered with torch.distributed: on CPU each is a gloo group
    keeping three threads, so a process that builds the groups again and again (a test training
    every layout, runs one after another) piled up thousands of threads and slowed to a crawl.
    The gloo ones are destroyed here; NCCL communicators are left to the process group's end."""
    if ps.model_parallel_is_initialized():
        if dist.is_initialized():
            for group in _forgotten_gloo_groups():
                dist.destroy_process_group(group)
        ps.destroy_model_parallel()
        gc.collect()  # the finished run's model and optimizer hold the groups in reference cycles


def _forgotten_gloo_groups() -> list:
    """The gloo groups megatron's parallel_state holds that destroy_model_parallel would only forget
    (not the *_GLOO ones, which it destroys itself), each once, never the default group."""
    seen, out = set(), []
    registered = dist.distributed_c10d._world.pg_map
    for name, value in vars(ps).items():
        if not name.startswith("_") or name.endswith("_GLOO"):
            continue
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if (isinstance(group, dist.ProcessGroup) and id(group) not in seen and group is not dist.group.WORLD
                    and group in registered and dist.get_backend(group) == "gloo"):
                seen.add(id(group))
                out.append(group)
    return out


def seed_everything(seed: int, env: DistEnv, cuda_graphs: bool = False) -> None:
    """Megatron-LM's seeding: one seed per pipeline stage, named streams for TP/EP regions.
    cuda_graphs: use megatron's graph-safe CUDA generators (its CUDA-graph layers require them)."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if env.on_cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs is True, force_reset_rng=True)
    else:
        from megatron_dmoe.compat.cpu.rng import seed_rng_trackers

        seed_rng_trackers(seed)


def destroy_distributed(abort: bool = False) -> None:
    """Tear the process groups down. abort=True after a failure on this rank: the other ranks may
    be waiting in a collective this rank will never join, and a graceful NCCL teardown then waits
    for them forever (destroy_process_group blocked until killed where abort returned at once:
    docs/performance.md, "Process-group teardown after a failure"), so the process could not exit
    and torchrun never stopped the job."""
    _forget_group_state()
    if not dist.is_initialized():
        return
    if abort and dist.get_world_size() > 1:
        abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort_group is not None:
            abort_group()
        # without it, leave the group to the process exit, which aborts an undestroyed group
        return
    dist.destroy_process_group()
    # the model, optimizer and hooks of a finished run hold megatron's groups in reference cycles;
    # each gloo group keeps three threads until it is freed, so free them now, not at the next
    # full collection (a process that trains several runs piled up thousands of such threads)
    gc.collect()
