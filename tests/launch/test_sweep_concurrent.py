"""`dmoe-sweep --concurrent N`: several local runs at once, each on the GPUs of its slot, with
stand-in training commands (tiny Python scripts) in place of dmoe-train.

Runs that must overlap meet at files: one creates a file the other waits for (with a time limit),
so a sweep that ran them one after another would fail the test instead of hanging.
"""
import io
import json
import os
import signal
import sys

import pytest

from megatron_dmoe.cli import sweep_main
from megatron_dmoe.config import Environment
from megatron_dmoe.sweep import commands, load_sweep, local, plan_runs, write_runs
from megatron_dmoe.sweep.gpu_slots import slot_devices

# argv: RUN_DIR SHARED ROLE ACTION...; ROLE "launcher" starts itself as a "worker" child and waits
# for it, like torchrun. Actions: touch:F (create SHARED/F), wait:F (wait for it; exit 3 after
# WAIT_S), say:TEXT (print it), exit:N. On SIGTERM (noted in SHARED/RUN.ROLE.sigterm) a waiting
# worker "saves" for half a second and exits 0.
STAND_IN = """
import os, pathlib, signal, subprocess, sys, time
run_dir, shared, role, actions = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
stopping = []
def on_term(*_):
    with open(shared / f"{run_dir.name}.{role}.sigterm", "a") as mark:
        mark.write("SIGTERM\\n")
    stopping.append(True)
def stop_when_told():  # as training does: save a checkpoint (taking a while), then exit 0
    if stopping:
        print("saving a checkpoint, stopping", flush=True)
        time.sleep(0.5)
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if role == "launcher":
    sys.exit(subprocess.call([sys.executable, __file__, str(run_dir), str(shared), "worker", *actions]))
(run_dir / "devices").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
print(f"step 1 of {run_dir.name}", flush=True)
for verb, _, arg in (a.partition(":") for a in actions):
    if verb == "touch":
        (shared / arg).write_text("")
    elif verb == "wait":
        deadline = time.monotonic() + WAIT_S
        while not (shared / arg).exists():
            stop_when_told()
            if time.monotonic() > deadline:
                print(f"{arg} never came", flush=True)
                sys.exit(3)
            time.sleep(0.01)
    elif verb == "say":
        print(arg, flush=True)
    elif verb == "exit":
        sys.exit(int(arg))
print(f"done {run_dir.name}", flush=True)
"""
WAIT_S = 15
MEET = {"seed=1": ["touch:a", "wait:b"], "seed=2": ["touch:b", "wait:a"]}  # only side by side


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    """(plan(n runs, **overrides), the sweep file, the shared folder); stand-in runs whose actions
    per run name are set with ``sweep.actions[name] = [...]``."""
    script, shared = tmp_path / "stand_in.py", tmp_path / "shared"
    script.write_text(STAND_IN.replace("WAIT_S", str(WAIT_S)))
    shared.mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class Sweep:
        actions = {}
        role = "worker"
        path = tmp_path / "sweep.yaml"
        runs = tmp_path / "runs"

        def plan(self, n, overrides=""):
            seeds = ", ".join(str(i) for i in range(1, n + 1))
            self.path.write_text(f"base: tiny\n{overrides}grid: {{training.seed: [{seeds}]}}\n")
            return plan_runs(load_sweep(self.path), self.runs, Environment.detect())

    s = Sweep()
    s.shared = shared
    monkeypatch.setattr(local, "train_command", lambda run_dir, n: [
        sys.executable, str(script), str(run_dir), str(shared), s.role,
        *s.actions.get(run_dir.name, [])])
    return s


def _devices(run):
    return (run.run_dir / "devices").read_text()


def test_runs_train_side_by_side_with_their_names_on_the_terminal_only(sweep):
    planned = sweep.plan(2)
    sweep.actions = MEET
    out = io.StringIO()
    results = local.run_locally(planned, concurrent=2, device_count=0, out=out)
    assert [r.returncode for r in results] == [0, 0], out.getvalue()
    text = out.getvalue()
    for number, run in enumerate(planned, start=1):
        name = run.point.name
        assert f"[{number}/2] {name}: training in {run.run_dir}\n" in text
        assert f"[{name}] step 1 of {name}\n" in text and f"[{name}] done {name}\n" in text
        assert f"[{number}/2] {name}: ended (exit status 0)\n" in text
        assert (run.run_dir / "train.log").read_text() == f"step 1 of {name}\ndone {name}\n"
        assert _devices(run) == "unset"  # no GPU: the runs share the CPU


@pytest.mark.parametrize("nproc, gpus, parent, expected", [
    (1, 2, None, ["0", "1"]),
    (2, 4, None, ["0,1", "2,3"]),
    (1, 8, None, ["0", "1"]),
    (2, 4, "7,5,3,1", ["7,5", "3,1"]),  # the sweep's own CUDA_VISIBLE_DEVICES, indexed
], ids=["1_gpu_each", "2_gpus_each", "spare_gpus", "within_parent_list"])
def test_each_slot_gets_its_own_gpus(sweep, monkeypatch, nproc, gpus, parent, expected):
    if parent is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    planned = sweep.plan(2)
    sweep.actions = MEET
    out = io.StringIO()
    results = local.run_locally(planned, nproc_per_node=nproc, concurrent=2, device_count=gpus,
                                out=out)
    assert [r.returncode for r in results] == [0, 0], out.getvalue()
    assert [_devices(run) for run in planned] == expected


def test_a_run_that_ends_frees_its_slot_for_the_next_run(sweep):
    planned = sweep.plan(3)
    # run 2 ends only once run 3 has started: run 3 must take run 1's slot while run 2 trains
    sweep.actions = {"seed=1": [], "seed=2": ["wait:c"], "seed=3": ["touch:c"]}
    out = io.StringIO()
    results = local.run_locally(planned, concurrent=2, device_count=2, out=out)
    assert [r.returncode for r in results] == [0, 0, 0], out.getvalue()
    assert [_devices(run) for run in planned] == ["0", "1", "0"]


def test_finished_runs_are_skipped_and_take_no_slot(sweep):
    overrides = "overrides: {training.train_iters: 2, checkpoint.save_interval: 0}\n"
    planned = sweep.plan(3, overrides)
    write_runs(load_sweep(sweep.path), planned, sweep.runs)
    (planned[1].run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    sweep.actions = {"seed=1": ["touch:a", "wait:b"], "seed=3": ["touch:b", "wait:a"]}
    out = io.StringIO()
    results = local.run_locally(planned, concurrent=2, device_count=2, out=out)
    assert [(r.returncode, r.skipped) for r in results] == [(0, False), (None, True), (0, False)]
    assert "[2/3] seed=2: finished (2 steps) earlier, skipped\n" in out.getvalue()
    assert not (planned[1].run_dir / "devices").exists()
    assert [_devices(planned[0]), _devices(planned[2])] == ["0", "1"]


def test_a_failing_run_is_reported_and_the_sweep_fails(sweep, monkeypatch, capsys):
    sweep.plan(2)
    sweep.actions = {"seed=1": ["touch:a", "wait:b", "exit:5"], "seed=2": ["touch:b", "wait:a"]}
    monkeypatch.setattr(commands, "gpu_count", lambda: 0)  # a CPU machine, wherever this runs
    assert sweep_main([str(sweep.path), "--runs-dir", str(sweep.runs), "--concurrent", "2"]) == 1
    out = capsys.readouterr().out
    log = sweep.runs / "seed=1" / "train.log"
    assert f"[1/2] seed=1: failed with exit status 5; its output is in {log}\n" in out
    assert "[2/2] seed=2: ended (exit status 0)\n" in out
    assert "1 of 2 runs failed: seed=1\n" in out


class _SignalWhenReady(io.StringIO):
    """Terminal output that sends this process SIGTERM when a training says it is ready, and
    again when one says it is saving."""

    def write(self, text):
        super().write(text)
        if text.endswith(("] ready\n", "] saving a checkpoint, stopping\n")):
            os.kill(os.getpid(), signal.SIGTERM)
        return len(text)


@pytest.mark.parametrize("role", ["worker", "launcher"], ids=["plain", "torchrun"])
def test_sigterm_reaches_every_running_training_and_starts_no_other(sweep, role):
    planned = sweep.plan(3)
    sweep.role = role
    # runs 1 and 2 meet, say so, then wait for a file nobody makes (and fail after WAIT_S)
    sweep.actions = {name: actions + ["say:ready", "wait:never"] for name, actions in MEET.items()}
    handler = signal.getsignal(signal.SIGTERM)
    out = _SignalWhenReady()
    results = local.run_locally(planned, nproc_per_node=2 if role == "launcher" else 1,
                                concurrent=2, device_count=0, out=out)
    assert [r.returncode for r in results[:2]] == [0, 0], out.getvalue()
    assert results[2].returncode is None and not results[2].skipped  # not started
    # the training processes got it, once each (a second could kill one on its way out), and
    # not a torchrun-like launcher
    marks = {p.name: p.read_text() for p in sweep.shared.glob("*.sigterm")}
    assert marks == {"seed=1.worker.sigterm": "SIGTERM\n", "seed=2.worker.sigterm": "SIGTERM\n"}
    assert "[3/3]" not in out.getvalue()
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.parametrize("concurrent, nproc, gpus, parent, message", [
    (3, 2, 4, None, "--concurrent 3 with --nproc-per-node 2 needs 6 GPUs, but this machine has 4: "
                    "lower --concurrent to at most 2"),
    (2, 8, 4, None, "needs 16 GPUs, but this machine has 4: lower --nproc-per-node to at most 4"),
    (2, 2, 2, "3,1", "needs 4 GPUs, but this machine has 2 (CUDA_VISIBLE_DEVICES=3,1): lower "
                     "--concurrent to at most 1"),
    (0, 1, 0, None, "--concurrent must be at least 1, got 0"),
])
def test_too_few_gpus_for_the_slots_is_an_error_naming_both_numbers(concurrent, nproc, gpus, parent,
                                                                    message):
    with pytest.raises(ValueError) as error:
        slot_devices(concurrent, nproc, gpus, parent)
    assert message in str(error.value)


def test_one_run_at_a_time_or_no_gpu_leaves_the_devices_alone():
    assert slot_devices(1, 8, 4) == [None]  # as without --concurrent: torchrun's own failure
    assert slot_devices(4, 2, 0) == [None] * 4  # a CPU machine: the runs share it


def test_too_many_gpus_asked_stops_the_sweep_before_anything_is_written(sweep, monkeypatch, capsys):
    sweep.plan(2)
    monkeypatch.setattr(commands, "gpu_count", lambda: 2)
    argv = [str(sweep.path), "--runs-dir", str(sweep.runs), "--concurrent", "2",
            "--nproc-per-node", "2"]
    assert sweep_main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("dmoe-sweep: error: --concurrent 2 with --nproc-per-node 2 needs 4 GPUs, but this "
                   "machine has 2: lower --concurrent to at most 1\n")
    assert not sweep.runs.exists()
