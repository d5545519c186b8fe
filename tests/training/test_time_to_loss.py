"""tools/time_to_loss.py on hand-written runs: labels from configs, the crossing of a target loss
interpolated between evaluations, speed-ups, runs that never get there, and old runs whose
training time is rebuilt from tokens/s."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "time_to_loss.py"
TOKENS_PER_STEP = 4 * 10  # global batch 4 x sequence 10, as in the configs below


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("time_to_loss", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write_run(folder: Path, experts: int, capacity, records):
    folder.mkdir(parents=True)
    factor = "null" if capacity is None else capacity
    (folder / "config.yaml").write_text(
        f"model: {{seq_length: 10}}\nmoe: {{num_experts: {experts}, expert_capacity_factor: "
        f"{factor}}}\ntraining: {{global_batch_size: 4}}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def timed(points, tokens_per_step=TOKENS_PER_STEP):
    """Records logging train_time_s and tokens: (step, seconds, validation loss)."""
    return [{"step": s, "loss": v + 0.1, "train_time_s": t, "tokens": s * tokens_per_step,
             "val_loss": v} for s, t, v in points]


@pytest.fixture
def four_runs(tmp_path):
    dense = write_run(tmp_path / "dense", 0, None,
                      timed([(10, 100.0, 4.0), (20, 200.0, 3.0), (30, 300.0, 2.5)]))
    dmoe = write_run(tmp_path / "dmoe", 8, None,
                     timed([(10, 50.0, 3.5), (20, 100.0, 2.7), (30, 150.0, 2.3)]))
    # an old run: no train_time_s or tokens, only tokens/s per logged interval (10, 6, 8, 8 s per
    # step), and a validation loss at step 15 between two log records
    def rate(seconds_per_step):
        return TOKENS_PER_STEP / seconds_per_step

    old = [{"step": 5, "loss": 4.0, "tokens_per_s": rate(10)},
           {"step": 10, "loss": 3.7, "tokens_per_s": rate(6), "val_loss": 3.6},
           {"step": 15, "val_loss": 3.2},
           {"step": 20, "loss": 3.0, "tokens_per_s": rate(8), "val_loss": 2.9},
           {"step": 30, "loss": 2.7, "tokens_per_s": rate(8), "val_loss": 2.6}]
    cf1 = write_run(tmp_path / "cf1", 8, 1.0, old)
    cf2 = write_run(tmp_path / "cf2", 8, 2.0,
                    timed([(10, 90.0, 3.4), (20, 180.0, 2.8), (30, 270.0, 2.55)]))
    return [dense, dmoe, cf1, cf2]


def test_speedups_and_interpolation(tool, four_runs, tmp_path, capsys):
    png, out = tmp_path / "ttq.png", tmp_path / "ttq.json"
    assert tool.main([*map(str, four_runs), "--png", str(png), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = {Path(r["run_dir"]).name: r for r in result["runs"]}
    assert [r["label"] for r in result["runs"]] == ["dense", "dMoE", "capacity-factor 1.0",
                                                   "capacity-factor 2.0"]
    assert result["dense"] == str(four_runs[0])
    assert result["best_capacity_factor"] == str(four_runs[3])  # 2.55 < 2.6

    # dense: 2.5 first reached at its last evaluation, 300 s, 1200 tokens
    own = runs["dense"]["to_dense_loss"]
    assert (own["train_time_s"], own["tokens"], own["speedup"]) == (300.0, 1200.0, 1.0)
    # dMoE: 2.5 halfway from (100 s, 2.7) to (150 s, 2.3): 125 s, 1000 tokens
    to_dense = runs["dmoe"]["to_dense_loss"]
    assert to_dense["train_time_s"] == pytest.approx(125.0, rel=1e-12)
    assert to_dense["tokens"] == pytest.approx(1000.0, rel=1e-12)
    assert to_dense["speedup"] == pytest.approx(300.0 / 125.0, rel=1e-12)
    assert to_dense["token_ratio"] == pytest.approx(1.2, rel=1e-12)
    # best capacity-factor run's 2.55 (its own time: 270 s): dMoE at 3/8 of the way from 100 s
    to_best = runs["dmoe"]["to_best_capacity_factor_loss"]
    assert to_best["target_val_loss"] == 2.55 and to_best["reference_train_time_s"] == 270.0
    assert to_best["train_time_s"] == pytest.approx(118.75, rel=1e-12)
    assert to_best["speedup"] == pytest.approx(270.0 / 118.75, rel=1e-12)
    assert runs["cf2"]["to_best_capacity_factor_loss"]["speedup"] == 1.0
    assert runs["dense"]["to_best_capacity_factor_loss"] is None  # only MoE runs are compared
    # capacity factor 1.0 never gets to 2.5 or 2.55
    for key in ("to_dense_loss", "to_best_capacity_factor_loss"):
        assert runs["cf1"][key]["reached"] is False and "train_time_s" not in runs["cf1"][key]

    # the old run's time, rebuilt from tokens/s: 50 s at step 5, 80 at 10, 120 at 15, 240 at 30
    assert runs["cf1"]["time_source"] == "tokens_per_s"
    assert [(p["step"], p["time_s"], p["tokens"]) for p in runs["cf1"]["curve"]] == [
        (10, 80.0, 400), (15, 120.0, 600), (20, 160.0, 800), (30, 240.0, 1200)]
    assert runs["cf1"]["train_time_s"] == 240.0
    assert runs["dmoe"]["tokens_per_s"] == pytest.approx(1200 / 150.0)
    assert runs["dmoe"]["epochs"] is None  # no data files to count an epoch by

    table = capsys.readouterr().out
    dmoe_row = next(line for line in table.splitlines() if line.startswith("| dmoe |"))
    assert "| 2.1 min / 1.00k tok | 2.40x |" in dmoe_row and "| 2.27x |" in dmoe_row
    cf1_row = next(line for line in table.splitlines() if line.startswith("| cf1 |"))
    assert cf1_row.count("not reached") == 2
    note = next(line for line in table.splitlines() if "rebuilt from logged tokens/s" in line)
    assert note.endswith(": cf1")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_first_reach_edge_cases(tool):
    P = tool.EvalPoint
    points = [P(1, 10.0, 100, 3.0), P(2, 20.0, 200, 2.0), P(3, 30.0, 300, 2.5)]
    assert tool.first_reach(points, 3.5) == (10.0, 100.0)  # already at the first evaluation
    assert tool.first_reach(points, 2.5) == (15.0, 150.0)  # the first crossing, not the last
    assert tool.first_reach(points, 1.9) is None


def test_input_mistakes_are_reported(tool, four_runs, tmp_path, capsys):
    no_eval = write_run(tmp_path / "no_eval", 0, None, [{"step": 1, "loss": 3.0,
                                                          "train_time_s": 1.0}])
    assert tool.main([str(no_eval), "--png", str(tmp_path / "a.png"),
                      "--json", str(tmp_path / "a.json")]) == 2
    assert "no validation loss" in capsys.readouterr().err
    second_dense = write_run(tmp_path / "dense2", 0, None, timed([(10, 10.0, 3.0)]))
    assert tool.main([*map(str, four_runs), str(second_dense)]) == 2
    assert "--dense RUN_DIR" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()


def test_epochs_from_a_given_token_count(tool, four_runs, tmp_path, capsys):
    """--train-tokens stands in for data files that cannot be read here: dMoE saw 1200 tokens."""
    out = tmp_path / "e.json"
    args = [*map(str, four_runs), "--png", str(tmp_path / "e.png"), "--json", str(out)]
    assert tool.main([*args, "--train-tokens", "800"]) == 0
    runs = {Path(r["run_dir"]).name: r for r in json.loads(out.read_text())["runs"]}
    assert runs["dmoe"]["epochs"] == pytest.approx(1.5, rel=1e-12)
    assert "| 1.50 |" in next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| dmoe |"))
    assert tool.main([*args, "--train-tokens", "0"]) == 2
    assert "--train-tokens 0" in capsys.readouterr().err
