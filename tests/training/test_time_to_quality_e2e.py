"""Time to quality end to end on CPU: a corpus from tools/make_corpus.py, a dense run and a dMoE run
stopped by training.time_limit_minutes (evaluated and checkpointed; a resume trains no further),
both trained on separate validation data, then tools/time_to_loss.py over the two runs."""
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dmoe.training.metrics_log import read_metrics
from train_helpers import SMALL, train_command

TOOLS = Path(__file__).resolve().parents[2] / "tools"
WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "value", "=", "(", ")",
         ":", "items", "total", "print"]
LIMIT_MINUTES = 0.005  # 0.3 s of training steps: a few CPU steps of the tiny model
# s: a deadline for each command that only a hung one reaches (a run here takes well under a
# minute; a busy machine may take several). What the test checks is read from the runs' own
# records, never from how long they took.
HANG = 500


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tools():
    modules = {name: _load(name) for name in ("make_corpus", "time_to_loss")}
    yield modules
    for name in modules:
        del sys.modules[name]


def _interpolated(points, target):
    """The crossing computed here, independently of the tool."""
    for before, after in zip([None] + points[:-1], points):
        if after["val_loss"] <= target:
            if before is None:
                return after["time_s"]
            share = (before["val_loss"] - target) / (before["val_loss"] - after["val_loss"])
            return before["time_s"] + share * (after["time_s"] - before["time_s"])
    return None


@pytest.mark.slow
@pytest.mark.timeout(3 * HANG)
def test_dense_and_time_limited_dmoe_compared(tools, tmp_path, capsys):
    rng = random.Random(3)
    tree = tmp_path / "tree"
    for i in range(30):
        path = tree / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 10))) + "\n"
                                for _ in range(rng.randint(20, 60))))
    corpus = tmp_path / "corpus"
    assert tools["make_corpus"].main([str(tree), "--out", str(corpus), "--vocab-size", "300",
                                      "--valid-fraction", "0.2", "--workers", "1",
                                      "--no-progress"]) == 0
    data = json.loads((corpus / "summary.json").read_text())["overrides"]

    common = SMALL + data + ["training.eval_interval=2", "training.eval_iters=1",
                             "checkpoint.save_interval=100"]
    dense_dir, dmoe_dir = tmp_path / "dense", tmp_path / "dmoe"
    # one thread each: the dense run trains beside the dMoE run and its resume
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def start(run_dir, *args):
        return subprocess.Popen(train_command(run_dir, *args), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)

    def finish(job):
        out = job.communicate(timeout=HANG)[0]
        assert job.returncode == 0, out[-3000:]
        return out

    dense_job = start(dense_dir, *common, "moe.num_experts=0", "training.train_iters=6")
    out = finish(start(dmoe_dir, *common, "training.train_iters=200",
                       f"training.time_limit_minutes={LIMIT_MINUTES}"))

    # the time limit stopped the dMoE run early: evaluated, checkpointed, its time recorded
    records = read_metrics(dmoe_dir)
    stopped = records[-1]["step"]
    assert stopped < 200 and f"stopping at step {stopped}: training.time_limit_minutes" in out
    assert int((dmoe_dir / "checkpoints" / "latest").read_text()) == stopped
    assert "val_loss" in records[-1]
    assert records[-1]["train_time_s"] >= LIMIT_MINUTES * 60
    assert all(r["train_time_s"] < LIMIT_MINUTES * 60 for r in records[:-1])
    assert [r["tokens"] for r in records] == [r["step"] * 8 * 64 for r in records]
    # resumed, it trains no further
    assert "was spent at step" in finish(start(dmoe_dir, "--resume"))
    assert read_metrics(dmoe_dir) == records
    assert int((dmoe_dir / "checkpoints" / "latest").read_text()) == stopped
    finish(dense_job)

    out_json = tmp_path / "ttq.json"
    assert tools["time_to_loss"].main([str(dense_dir), str(dmoe_dir), "--png",
                                       str(tmp_path / "ttq.png"), "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    result = {Path(r["run_dir"]).name: r for r in json.loads(out_json.read_text())["runs"]}
    dense, dmoe = result["dense"], result["dmoe"]
    assert (dense["label"], dmoe["label"]) == ("dense", "dMoE")
    assert [p["step"] for p in dense["curve"]] == [2, 4, 6]
    assert dense["final_val_loss"] == read_metrics(dense_dir)[-1]["val_loss"]
    dense_tokens = read_metrics(dense_dir)[-1]["tokens"]
    assert dense["tokens"] == dense_tokens == 6 * 8 * 64
    train_tokens = json.loads((corpus / "summary.json").read_text())["tokens"]["train"]
    assert dense["epochs"] == pytest.approx(dense_tokens / train_tokens)
    target = dense["final_val_loss"]
    dense_time = _interpolated(dense["curve"], target)
    reached = _interpolated(dmoe["curve"], target)
    entry = dmoe["to_dense_loss"]
    assert entry["reference_train_time_s"] == pytest.approx(dense_time)
    if reached is None:
        assert entry["reached"] is False
        assert "not reached" in next(line for line in table.splitlines() if line.startswith("| dmoe |"))
    else:
        assert entry["train_time_s"] == pytest.approx(reached)
        assert entry["speedup"] == pytest.approx(dense_time / reached)
    assert (tmp_path / "ttq.png").read_bytes()[:4] == b"\x89PNG"
