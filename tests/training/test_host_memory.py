"""Memory on a CPU: a run whose estimate exceeds what this machine has available is refused in one
line before its data or model, saying what would fit; an allocation failure during a run is one
line; a run directory whose run stopped before its first step is reused by a plain rerun."""
import json

import pytest

from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.training import host_memory, memory_estimate as me
from megatron_dmoe.training.out_of_memory import host_out_of_memory_message
from megatron_dmoe.training.run_dir import unstarted_run_note
from train_helpers import snapshot

GIB = 2**30
# larger than any machine: ~2.7 TB of fp32 weights alone
HUGE = ["model.hidden_size=16384", "model.num_attention_heads=16", "moe.num_experts=512", "moe.ffn_hidden_size=65536"]


def _cfg(*overrides):
    return resolve(load_config(None, list(overrides)))


def test_the_estimate_of_the_machines_processes_is_checked_against_its_available_memory():
    cfg = _cfg("training.micro_batch_size=8", "training.global_batch_size=8")
    need = me.estimate_memory(cfg, 4096, 1, on_cuda=False).total
    me.check_host_memory(cfg, 4096, 1, 1, available_bytes=int(need / 0.9) + 1)  # fits under 90%
    with pytest.raises(me.MemoryCheckError) as refused:
        me.check_host_memory(cfg, 4096, 2, 2, available_bytes=int(need / 0.9))  # two processes: twice
    line = str(refused.value)
    assert "\n" not in line and "x 2 processes" in line and "training.memory_check=false runs it anyway" in line
    me.check_host_memory(_cfg("training.memory_check=false"), 4096, 1, 1, available_bytes=1)


def test_the_refusal_names_what_would_fit():
    cfg = _cfg("training.micro_batch_size=8", "training.global_batch_size=8")
    whole = me.estimate_memory(cfg, 4096, 1, on_cuda=False)
    smaller = me.estimate_memory(_cfg("training.micro_batch_size=1", "training.global_batch_size=8"), 4096, 1,
                                 on_cuda=False)
    room = int((smaller.total + whole.total) / 2 / 0.9)  # the smallest micro-batch fits, the run does not
    with pytest.raises(me.MemoryCheckError, match=r"these would fit: training.micro_batch_size=\d"):
        me.check_host_memory(cfg, 4096, 1, 1, available_bytes=room)


def test_a_cgroup_limit_caps_the_available_memory(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    monkeypatch.setattr(host_memory, "_CGROUP", tmp_path)
    assert host_memory.available_host_bytes() == min(2 * GIB, host_memory.available_host_bytes())
    assert host_memory._cgroup_room() == 2 * GIB
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory._cgroup_room() is None


def test_a_model_too_large_for_this_machine_is_refused_in_one_line_before_work(cli_run, tmp_path, monkeypatch):
    from megatron_dmoe.training import setup

    monkeypatch.setattr(setup, "prepare_run_data", lambda *a: pytest.fail("data prepared before the check"))
    run = tmp_path / "run"
    result = cli_run(run, *HUGE, "logging.progress_bar=off")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    available = host_memory.available_host_bytes() / GIB
    assert len(lines) == 1 and lines[0].startswith("dmoe-train: error: ~"), result.stderr
    assert "GiB per process estimated" in lines[0] and "this machine has available" in lines[0]
    # the figure read by the code is the one named (to the 0.1 GiB printed, give or take what moved)
    named = float(lines[0].split(" GiB this machine has available")[0].rsplit("of the ", 1)[1])
    assert abs(named - available) < 1.0
    assert snapshot(run) == {}


def test_an_allocation_failure_of_the_host_is_one_line():
    cfg = _cfg("training.micro_batch_size=4", "training.global_batch_size=8")
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 21474836480 bytes. Error code 12 (Cannot allocate memory)")
    line = host_out_of_memory_message(err, cfg, 2)
    assert "\n" not in line and "tried to allocate 20.00 GiB" in line
    assert "training.micro_batch_size (now 4" in line and "fewer processes (now 2)" in line
    assert host_out_of_memory_message(MemoryError(), cfg, 1).startswith("the machine ran out of memory")
    assert host_out_of_memory_message(RuntimeError("something else"), cfg, 1) is None
    try:  # raised from the allocation failure: the chain is read
        try:
            raise err
        except RuntimeError as inner:
            raise ValueError("a step failed") from inner
    except ValueError as outer:
        assert "tried to allocate 20.00 GiB" in host_out_of_memory_message(outer, cfg, 1)


def _stopped_before_its_first_step(run):
    """What a run that failed in its first step leaves: config.yaml, an empty metrics.jsonl and
    TensorBoard's folder."""
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "metrics.jsonl").write_text("")
    (run / "tensorboard").mkdir()


def test_a_run_stopped_before_its_first_step_is_replaced_without_overwrite(cli_run, tmp_path):
    run = tmp_path / "run"
    _stopped_before_its_first_step(run)
    assert "stopped before its first step" in unstarted_run_note(run)
    # the plain rerun passes the run directory's check (here it stops at the memory check instead)
    result = cli_run(run, *HUGE, "logging.progress_bar=off")
    assert result.returncode == 2 and "already holds" not in result.stderr
    assert f"{run} holds a run that stopped before its first step" in result.stdout
    assert "GiB per process estimated" in result.stderr


def test_a_run_that_stepped_or_saved_is_not_replaced(tmp_path):
    run = tmp_path / "run"
    _stopped_before_its_first_step(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0}) + "\n")
    assert unstarted_run_note(run) is None
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / "iter_0000001").mkdir(parents=True)
    assert unstarted_run_note(run) is None
    assert unstarted_run_note(tmp_path / "new") is None
