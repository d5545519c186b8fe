"""`dmoe-train --nproc-per-node N [--nnodes ...]`: the training processes started through torchrun's
own launcher (torch.distributed.run, its rendezvous and its elastic agent), after the configuration,
the run directory and the data were checked once in this process.

What it adds to plain torchrun (which keeps working): a refused configuration is one line before any
worker starts, and a worker that fails is one line with its exit code instead of torchrun's
ChildFailedError summary; torchrun's own log lines (its OMP_NUM_THREADS banner, the closing signals
it sends, its failure report) are left out of this process's output. The workers' output passes
through unchanged.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
from typing import List, Optional

# dmoe-train's flag -> torchrun's; each also under torchrun's underscore spelling
LAUNCH_FLAGS = {
    "--nproc-per-node": "--nproc_per_node",
    "--nnodes": "--nnodes",
    "--node-rank": "--node_rank",
    "--master-addr": "--master_addr",
    "--master-port": "--master_port",
    "--rdzv-backend": "--rdzv_backend",
    "--rdzv-endpoint": "--rdzv_endpoint",
    "--rdzv-id": "--rdzv_id",
    "--rdzv-conf": "--rdzv_conf",
}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, got {text!r}")
    return value


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "several processes (torchrun's options, through torch.distributed.run)",
        "With --nproc-per-node, dmoe-train checks the configuration once, then starts the\n"
        "processes through torchrun's launcher; without it, dmoe-train is one process (or one\n"
        "of torchrun's workers when started by torchrun).")
    helps = {
        "--nproc-per-node": ("N", _positive, "start N training processes on this node (one per GPU on GPU "
                             "machines)"),
        "--nnodes": ("N", _positive, "number of nodes (default 1); run the same command on every node"),
        "--node-rank": ("R", int, "this node's rank, 0 to nnodes-1 (static rendezvous)"),
        "--master-addr": ("HOST", str, "node 0's address (static rendezvous)"),
        "--master-port": ("PORT", int, "node 0's port (static rendezvous; default: a free port on one node, "
                          "29500 on several)"),
        "--rdzv-backend": ("NAME", str, "torchrun's rendezvous backend (e.g. c10d) instead of the static one"),
        "--rdzv-endpoint": ("HOST:PORT", str, "where the nodes meet (with --rdzv-backend)"),
        "--rdzv-id": ("ID", str, "the job's id, the same on every node (with --rdzv-backend)"),
        "--rdzv-conf": ("KEY=VALUE,...", str, "more rendezvous settings (torchrun's --rdzv-conf)"),
    }
    for flag, (metavar, kind, text) in helps.items():
        spellings = dict.fromkeys([flag, LAUNCH_FLAGS[flag]])  # torchrun's underscore spelling too
        group.add_argument(*spellings, type=kind, default=None, metavar=metavar, help=text)
    group.add_argument("--torchrun-args", default=None, metavar="'OPTIONS'",
                       help="more of torchrun's own options, in one quoted string after '=' (e.g. "
                            "--torchrun-args='--max-restarts 3 --log-dir logs'); checked against torchrun's "
                            "parser before anything starts")


def _extra_torchrun_args(ns: argparse.Namespace) -> List[str]:
    return shlex.split(ns.torchrun_args or "")


def _unknown_torchrun_args(extra: List[str]) -> List[str]:
    """The options of `extra` that torchrun's own parser does not take, and any script it names."""
    import torch.distributed.run as torchrun

    try:
        known, unknown = torchrun.get_args_parser().parse_known_args([*extra, "-m", "megatron_dmoe"])
    except SystemExit:  # an option missing its value: argparse has printed why
        return extra
    if known.training_script != "megatron_dmoe" or known.training_script_args:  # a script of its own
        unknown = [*unknown, known.training_script, *known.training_script_args[:-2]]  # less our -m
    return unknown


def launch_problem(ns: argparse.Namespace) -> Optional[str]:
    """A launch flag given without --nproc-per-node, or a node rank outside the nodes (None: fine)."""
    given = [flag for flag in [*LAUNCH_FLAGS, "--torchrun-args"] if flag != "--nproc-per-node"
             and getattr(ns, flag[2:].replace("-", "_")) is not None]
    if ns.nproc_per_node is None:
        return f"{given[0]} needs --nproc-per-node, the number of processes per node" if given else None
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None or "LOCAL_RANK" in os.environ:
        return "--nproc-per-node starts the processes itself: run dmoe-train --nproc-per-node without torchrun"
    nodes = ns.nnodes or 1
    if ns.node_rank is not None and not 0 <= ns.node_rank < nodes:
        return f"--node-rank {ns.node_rank}: use this node's rank, 0 to {nodes - 1}"
    if nodes > 1 and ns.master_addr is None and ns.rdzv_endpoint is None:
        return (f"--nnodes {nodes} needs a rendezvous: --master-addr (node 0's address) with --node-rank, "
                "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID")
    try:
        extra = _extra_torchrun_args(ns)
    except ValueError as err:
        return f"--torchrun-args {ns.torchrun_args!r}: {err}; quote it as one shell word"
    unknown = _unknown_torchrun_args(extra)
    if unknown:
        return (f"--torchrun-args: torchrun does not take {' '.join(unknown)!r}; see `torchrun --help` (the "
                "training script and its arguments are dmoe-train's own)")
    return None


def world_size(ns: argparse.Namespace) -> int:
    return ns.nproc_per_node * (ns.nnodes or 1)


def torchrun_args(ns: argparse.Namespace, worker_args: List[str]) -> List[str]:
    """torch.distributed.run's command line: the given launch flags and --torchrun-args, then
    `-m megatron_dmoe` with the workers' arguments."""
    args = []
    for flag, theirs in LAUNCH_FLAGS.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None:
            args += [theirs, str(value)]
    return [*args, *_extra_torchrun_args(ns), "-m", "megatron_dmoe", *worker_args]


def _quiet_torchrun_logs() -> None:
    """torchrun's launcher logs to stderr through `torch.distributed`'s handler (the OMP_NUM_THREADS
    banner, 'Sending process ... closing signal', the failed worker's report); in this process its
    loggers stop at a handler that drops them. What they say is told as one line below, or by the
    workers."""
    for name in ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"):
        quiet = logging.getLogger(name)
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False


def _failure_line(err) -> Optional[str]:
    """The line for the first worker that failed; None when a worker exited with 2, dmoe-train's code
    for a refusal its rank 0 has already told in one line."""
    failures = err.failures
    if any(failure.exitcode == 2 for failure in failures.values()):
        return None
    rank, failure = err.get_first_failure()
    how = (f"was ended by {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return f"training process of rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"


def launch(ns: argparse.Namespace, worker_args: List[str], prog: str = "dmoe-train") -> int:
    """Run the workers to their end: 0 when all succeed; otherwise the failing worker's exit code
    (with one line, unless it told its own), 130 after Ctrl-C, 0 after SIGTERM (the workers save and
    exit, as one process does)."""
    import sys

    import torch.distributed as dist
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    _quiet_torchrun_logs()
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(ns, worker_args)))
    except ChildFailedError as err:
        line = _failure_line(err)
        if line is None:
            return 2
        print(f"{prog}: error: {line}", file=sys.stderr)
        _, failure = err.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as err:
        return 0 if err.sigval == signal.SIGTERM else 128 + int(err.sigval)
    except (RendezvousError, dist.DistError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{prog}: error: the processes could not meet ({first}); check --master-addr/--master-port "
              "or --rdzv-endpoint, and that every node runs the same command", file=sys.stderr)
        return 2
    return 0
