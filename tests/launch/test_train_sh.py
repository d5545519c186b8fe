"""scripts/train.sh: the launcher command (dmoe-train --nproc-per-node) it builds from the
environment, its errors, and a real two-process CPU run of the tiny config."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dmoe.sweep.status import run_status
from train_helpers import losses

TRAIN_SH = str(Path(__file__).resolve().parents[2] / "scripts" / "train.sh")
LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               "RDZV_ENDPOINT", "RDZV_ID", "TORCHRUN_ARGS", "LAUNCHER_PID_FILE")


def _train_sh(*args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run(["bash", TRAIN_SH, *args], capture_output=True, text=True, timeout=600,
                          env={**clean, "PYTHON": sys.executable, **env})


def _command(*args, **env):
    proc = _train_sh("--dry-run", *args, **env)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def test_help_describes_the_environment():
    proc = _train_sh("--help")
    assert proc.returncode == 0
    for name in LAUNCH_VARS:
        assert name in proc.stdout


def test_one_node_is_standalone_with_one_process_per_cpu_machine():
    command = _command("tiny", "moe.top_k=1", "--", "--run-dir", "runs/x", "--resume")
    # no GPU here: one process; the `--` is dropped (dmoe-train reads its flags anywhere)
    assert command == [sys.executable, "-m", "megatron_dmoe", "--nproc-per-node=1",
                       "tiny", "moe.top_k=1", "--run-dir", "runs/x", "--resume"]


def test_static_and_c10d_rendezvous_come_from_the_environment():
    static = _command("tiny", NNODES="2", NODE_RANK="1", MASTER_ADDR="node0", MASTER_PORT="1234",
                      NPROC_PER_NODE="8", TORCHRUN_ARGS="--max_restarts 2")
    assert static[3:] == ["--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=node0",
                          "--master-port=1234", "--torchrun-args=--max_restarts 2", "tiny"]
    c10d = _command(NNODES="4", RDZV_ENDPOINT="node0:29400", RDZV_ID="job7", NPROC_PER_NODE="2")
    assert c10d[3:] == ["--nproc-per-node=2", "--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
                        "--rdzv-id=job7"]


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2"}, "NNODES=2 needs a rendezvous"),
    ({"NNODES": "2", "MASTER_ADDR": "h", "NODE_RANK": "2"}, "NODE_RANK=2: use this node's rank, 0 to 1"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0"),
    ({"NNODES": "two"}, "NNODES=two"),
    ({"RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT=node0: use host:port"),
    ({"PYTHON": "/no/such/python"}, "PYTHON=/no/such/python is not a command"),
])
def test_launch_mistakes_fail_with_one_message(env, message):
    proc = _train_sh("--dry-run", "tiny", **env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("train.sh: error: ") and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_two_cpu_processes_train_the_tiny_config(tmp_path, small_run):
    run_dir = tmp_path / "run"
    logs = tmp_path / "torchrun-logs"
    proc = _train_sh("tiny", *small_run(3), "--", "--run-dir", str(run_dir),
                     NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
                     TORCHRUN_ARGS=f"--log_dir {logs} --redirects 3",
                     LAUNCHER_PID_FILE=str(tmp_path / "torchrun.pid"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 node(s) x 2 process(es), standalone" in proc.stderr
    # torchrun wrote one output folder per rank: two training processes ran
    ranks = {p.parent.name for p in logs.rglob("stdout.log")}
    assert ranks == {"0", "1"}, sorted(logs.rglob("*"))
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert run_status(run_dir).finished
    assert int((tmp_path / "torchrun.pid").read_text()) > 0
