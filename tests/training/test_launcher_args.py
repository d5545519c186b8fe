"""dmoe-train --nproc-per-node: the launch flags as the launcher's own command line, their misuse,
a refused configuration told once before any process starts, and a failed worker as one line with
its exit code. (The processes themselves: tests/training/test_launcher.py.)"""
import argparse

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_dmoe import launcher
from megatron_dmoe.cli import parse_train_args


def _ns(**given):
    flags = {flag[2:].replace("-", "_"): None for flag in [*launcher.LAUNCH_FLAGS, "--torchrun-args"]}
    return argparse.Namespace(**{**flags, **given})


def test_the_launch_flags_become_the_launchers_own_and_the_workers_run_megatron_dmoe():
    ns, config, overrides = parse_train_args(["tiny", "--nproc_per_node", "2", "moe.top_k=1", "--nnodes=2",
                                              "--master-addr", "node0", "--node-rank", "1", "--run-dir", "R"])
    assert (ns.nproc_per_node, ns.nnodes, ns.master_addr, ns.node_rank) == (2, 2, "node0", 1)
    assert launcher.world_size(ns) == 4
    assert launcher.torchrun_args(ns, ["tiny", "moe.top_k=1", "--run-dir", "R"]) == [
        "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "node0",
        "-m", "megatron_dmoe", "tiny", "moe.top_k=1", "--run-dir", "R"]


def test_more_torchrun_options_go_to_torchrun_before_the_workers_module():
    ns, _, _ = parse_train_args(["tiny", "--nproc-per-node", "2", "--torchrun-args=--max-restarts 3 --log_dir L"])
    assert launcher.torchrun_args(ns, ["tiny"]) == [
        "--nproc_per_node", "2", "--max-restarts", "3", "--log_dir", "L", "-m", "megatron_dmoe", "tiny"]


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "--nnodes needs --nproc-per-node"),
    (["--torchrun-args=--max-restarts 3"], "--torchrun-args needs --nproc-per-node"),
    (["--nproc-per-node", "2", "--torchrun-args=--max-restarts 3 --bogus"],
     "--torchrun-args: torchrun does not take '--bogus'"),
    (["--nproc-per-node", "2", "--torchrun-args", "train.py --lr 1"],
     "--torchrun-args: torchrun does not take 'train.py --lr 1'"),
    (["--nproc-per-node", "0"], "argument --nproc-per-node/--nproc_per_node: takes a whole number of at least 1, "
                                "got '0'"),
    (["--nproc-per-node", "2", "--nnodes", "2"], "--nnodes 2 needs a rendezvous"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h", "--node-rank", "2"],
     "--node-rank 2: use this node's rank, 0 to 1"),
])
def test_misused_launch_flags_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_train_args(args)
    assert stop.value.code == 2
    assert f"dmoe-train: error: {message}" in capsys.readouterr().err


def test_inside_a_launched_process_the_launch_flags_are_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "without torchrun" in launcher.launch_problem(_ns(nproc_per_node=2))


@pytest.mark.parametrize("override, message", [
    ("training.trian_iters=3", "training.trian_iters: unknown key; did you mean training.train_iters?"),
    ("moe.top_k=0", "moe.top_k: 0 is out of range"),
    ("data.tokenizer_model=MISSING", "data.tokenizer_model: tokenizer model not found"),
])
def test_a_refused_configuration_is_one_line_before_any_process_starts(override, message, cli_run, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("processes started"))
    args = [override.replace("MISSING", str(tmp_path / "missing.model"))]
    if override.startswith("data."):
        args.append(f"data.data_path=[{tmp_path}/corpus_text_document]")
    # the warm-up warning of this long run would come first were the run to start
    result = cli_run(tmp_path / "run", "--nproc-per-node", "2", "training.train_iters=150",
                     "training.lr_warmup_iters=200", *args)
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmoe-train: error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def _failure(**exits):
    """ChildFailedError as torch's agent raises it: {global rank: exit code} of the failed workers."""
    return ChildFailedError("megatron_dmoe", {int(rank[1:]): ProcessFailure(local_rank=int(rank[1:]), pid=100 + i,
                                                                          exitcode=code, error_file="<N/A>")
                                              for i, (rank, code) in enumerate(exits.items())})


def test_a_failed_worker_is_one_line_with_its_exit_code():
    assert launcher._failure_line(_failure(r1=1)) == \
        "training process of rank 1 (local rank 1, pid 100) exited with code 1"
    assert launcher._failure_line(_failure(r0=-9)) == \
        "training process of rank 0 (local rank 0, pid 100) was ended by SIGKILL"
    # exit 2: a refusal that rank 0 told in its own line; nothing is added
    assert launcher._failure_line(_failure(r0=2, r1=-15)) is None
