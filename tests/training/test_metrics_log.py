"""MetricsLogger: JSON lines, resume truncation, TensorBoard events, progress bar and log lines."""
import json
import random

import numpy as np
import pytest
import torch

from megatron_dmoe.training.metrics_log import (
    METRICS_FILE,
    MetricsLogger,
    format_log_line,
    moe_log_values,
    read_metrics,
)


def random_values(rng: random.Random, layers=3, experts=4, eval_step=False):
    values = {
        "loss": rng.uniform(2, 8), "lr": rng.uniform(1e-5, 1e-3), "grad_norm": rng.uniform(0, 3),
        "tokens_per_s": rng.uniform(1e3, 1e6), "tflops_per_gpu": rng.uniform(1, 500),
        "mfu": rng.uniform(0, 0.6), "lb_loss": rng.uniform(0, 0.1), "z_loss": rng.uniform(0, 0.01),
        "expert_load_imbalance": [rng.uniform(1, 3) for _ in range(layers)],
        "expert_load": [[rng.randint(0, 100) for _ in range(experts)] for _ in range(layers)],
        "note": rng.choice(["a", "b"]),  # an extra key passes through
    }
    if eval_step:
        values["val_loss"] = rng.uniform(2, 8)
    return values


def quiet_logger(run_dir, **kwargs):
    kwargs.setdefault("tensorboard", False)
    kwargs.setdefault("progress_bar", "off")
    return MetricsLogger(run_dir, **kwargs)


def test_lines_round_trip(tmp_path):
    rng = random.Random(0)
    expected = []
    with quiet_logger(tmp_path, total_steps=10) as logger:
        for step in range(1, 6):
            values = random_values(rng, eval_step=step % 2 == 0)
            logger.log(step, values)
            expected.append({"step": step, **values})
    assert read_metrics(tmp_path) == expected
    assert read_metrics(tmp_path / METRICS_FILE) == expected
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]


def test_tensors_and_numpy_values_become_json(tmp_path):
    load = torch.rand(2, 5)
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"loss": torch.tensor(2.5), "grad_norm": np.float32(0.25),
                       "expert_load": load, "expert_load_imbalance": np.array([1.5, 2.0]),
                       "tokens": np.int64(7), "nan_loss": float("nan")})
    (record,) = read_metrics(tmp_path)
    assert record["loss"] == 2.5 and record["grad_norm"] == 0.25 and record["tokens"] == 7
    assert record["expert_load"] == load.tolist()
    assert record["expert_load_imbalance"] == [1.5, 2.0]
    assert np.isnan(record["nan_loss"])


def test_lines_are_flushed_before_close(tmp_path):
    logger = quiet_logger(tmp_path)
    logger.log(1, {"loss": 3.0})
    logger.log(2, {"loss": 2.0})
    assert [r["loss"] for r in read_metrics(tmp_path)] == [3.0, 2.0]  # a killed run keeps these
    logger.close()
    logger.close()  # closing twice is harmless


def test_resume_truncates_later_steps(tmp_path):
    rng = random.Random(1)
    with quiet_logger(tmp_path) as logger:
        for step in range(1, 11):
            logger.log(step, random_values(rng))
            if step == 5:
                logger.log(step, {"val_loss": 4.0})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 11, "loss": 1.')  # a line cut off when the run was killed
    # The checkpoint being resumed is from step 6: steps 7..10 will be redone.
    with quiet_logger(tmp_path, start_step=6) as logger:
        kept = read_metrics(tmp_path)
        assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 5, 6]
        for step in (7, 8):
            logger.log(step, {"loss": float(step)})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert records[:7] == kept and records[-1]["loss"] == 8.0


def test_fresh_start_replaces_old_lines(tmp_path):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"loss": 9.0})
    with quiet_logger(tmp_path, start_step=0) as logger:
        logger.log(1, {"loss": 5.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 5.0}]


def test_read_metrics_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
        read_metrics(tmp_path)
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)
    path.write_text('{"step": 1}\n{"loss": 2.0}\n')
    with pytest.raises(ValueError, match="'step'"):
        read_metrics(tmp_path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="logging.progress_bar"):
        MetricsLogger(tmp_path, progress_bar="yes")
    with quiet_logger(tmp_path) as logger:
        with pytest.raises(ValueError, match="step"):
            logger.log(3, {"step": 4, "loss": 1.0})
        with pytest.raises(TypeError, match="'weird'"):
            logger.log(3, {"weird": object()})


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, enabled=False, tensorboard=True, progress_bar="on") as logger:
        logger.log(1, {"loss": 1.0})
        logger.message("hello")
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events(tmp_path):
    rng = random.Random(2)
    logged = []
    with quiet_logger(tmp_path, tensorboard=True) as logger:
        for step in range(1, 7):
            values = random_values(rng)
            logger.log(step, values)
            logged.append(values)
    log_dir = tmp_path / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    loss = scalars(log_dir, "loss")
    assert [s for s, _ in loss] == list(range(1, 7))
    assert [v for _, v in loss] == pytest.approx([v["loss"] for v in logged], rel=1e-6)
    layer3 = scalars(log_dir, "expert_load_imbalance/layer_3")  # without moe_layers: places from 1
    assert [v for _, v in layer3] == pytest.approx(
        [v["expert_load_imbalance"][2] for v in logged], rel=1e-6)

    # Resume from step 3: the first run's steps 4..6 are purged and replaced.
    with quiet_logger(tmp_path, tensorboard=True, start_step=3) as logger:
        logger.log(4, {"loss": 100.0})
        logger.log(5, {"loss": 200.0})
    loss = scalars(log_dir, "loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    assert [v for _, v in loss[3:]] == [100.0, 200.0]


def test_log_line_format():
    record = {"step": 20, "loss": 5.1234, "lr": 1.93e-3, "grad_norm": 0.8412,
              "tokens_per_s": 12345.0, "tflops_per_gpu": 3.21, "mfu": 0.1234,
              "lb_loss": 0.0123, "z_loss": 0.00101, "expert_load_imbalance": [1.2, 1.75, 1.1],
              "expert_load": [[1, 2]]}
    assert format_log_line(record, 300) == (
        "step 20/300 | loss 5.123 | lr 1.9e-03 | grad 0.841 | 12.3k tok/s | 3.21 TFLOP/s | "
        "MFU 12.3% | lb 0.0123 | z 0.00101 | imbalance 1.75 (max of 3 layers)")
    assert format_log_line({"step": 50, "val_loss": 4.5}) == "step 50 | val 4.5"


def test_progress_bar_off_prints_one_line_per_log(tmp_path, capsys):
    with quiet_logger(tmp_path, total_steps=300) as logger:
        logger.log(20, {"loss": 5.123, "lr": 1.9e-3, "tokens_per_s": 2.5e6})
        logger.message("evaluating")
        logger.log(40, {"loss": 4.25})
    assert capsys.readouterr().out.splitlines() == [
        "step 20/300 | loss 5.123 | lr 1.9e-03 | 2.5M tok/s", "evaluating",
        "step 40/300 | loss 4.25"]


def test_progress_bar_auto_is_off_without_terminal(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, progress_bar="auto", total_steps=5) as logger:
        logger.log(1, {"loss": 2.0})
    assert capsys.readouterr().out == "step 1/5 | loss 2\n"


def test_progress_bar_on(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, progress_bar="on", total_steps=10,
                       start_step=2) as logger:
        logger.advance(3)
        logger.log(4, {"loss": 3.5, "lr": 2e-4, "tokens_per_s": 1500.0})
        logger.message("checkpoint saved")
        logger.log(5, {"val_loss": 3.25})
    out = capsys.readouterr().out
    assert "5/10" in out
    assert "loss=3.5" in out and "lr=2.0e-04" in out and "tok/s=1.5k" in out and "val=3.25" in out
    assert "\ncheckpoint saved\n" in out.replace("\r", "\n")
    assert "step 4/10 |" not in out  # the bar replaces the log lines
    assert [r["step"] for r in read_metrics(tmp_path)] == [4, 5]


def test_moe_snapshot_becomes_per_layer_lists(tmp_path):
    rng = random.Random(3)
    loads = {n: [rng.randint(0, 50) for _ in range(4)] for n in (5, 1, 3)}
    snapshot = {"lb_loss": 0.5, "z_loss": 0.25, "load_imbalance": 9.0, "layers": {
        n: {"lb_loss": 0.5, "load": load, "load_imbalance": max(load) * 4 / sum(load)}
        for n, load in loads.items()}}
    del snapshot["layers"][3]["load_imbalance"]  # a layer whose imbalance was not recorded
    values = moe_log_values(snapshot)
    assert values == {
        "lb_loss": 0.5, "z_loss": 0.25, "moe_layers": [1, 3, 5],
        "expert_load_imbalance": [max(loads[1]) * 4 / sum(loads[1]), None,
                                  max(loads[5]) * 4 / sum(loads[5])],
        "expert_load": [loads[1], loads[3], loads[5]]}
    assert moe_log_values({}) == {}
    del snapshot["layers"][5]["load"]
    assert "expert_load" not in moe_log_values(snapshot)

    with quiet_logger(tmp_path, tensorboard=True) as logger:
        logger.log(1, values)
    assert read_metrics(tmp_path)[0]["expert_load_imbalance"][1] is None
    # TensorBoard numbers the layers as metrics.jsonl and the plots do (moe_layers)
    tags = [f"expert_load_imbalance/layer_{n}" for n in (1, 5)]
    assert [scalars(tmp_path / "tensorboard", tag) for tag in tags] == [
        [(1, pytest.approx(values["expert_load_imbalance"][n], rel=1e-6))] for n in (0, 2)]
    with pytest.raises(KeyError):
        scalars(tmp_path / "tensorboard", "expert_load_imbalance/layer_3")
    with pytest.raises(KeyError):
        scalars(tmp_path / "tensorboard", "moe_layers/layer_0")
