"""Loss and expert-load plots, and the tools/plot_runs.py command line."""
import importlib.util
import math
import random
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from megatron_dmoe.training.metrics_log import MetricsLogger, read_metrics
from megatron_dmoe.training.plots import _load_fractions, plot_expert_load, plot_runs

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_runs.py"


def write_run(run_dir, seed, steps=40, layers=0, experts=4):
    """A run whose loss decays, validation every 10 steps, expert load when layers > 0."""
    rng = random.Random(seed)
    loads = []
    with MetricsLogger(run_dir, tensorboard=False, progress_bar="off") as logger:
        for step in range(1, steps + 1):
            values = {"loss": 2 + 6 * math.exp(-step / 10) + rng.uniform(0, 0.2), "lr": 1e-3}
            if layers:
                load = [[rng.randint(0, 200) for _ in range(experts)] for _ in range(layers)]
                values["expert_load"] = load
                values["expert_load_imbalance"] = [max(r) * experts / sum(r) for r in load]
                loads.append(load)
            logger.log(step, values)
            if step % 10 == 0:
                logger.log(step, {"val_loss": 2.5 + 5 * math.exp(-step / 10)})
    return loads


def color_pixels(image, color, tolerance=0.03):
    rgb = np.asarray(to_rgb(color))
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tolerance).sum())


def read_png(path, min_kb=10):
    assert path.stat().st_size > min_kb * 1024
    return matplotlib.image.imread(path)


def test_one_run(tmp_path, capsys):
    write_run(tmp_path / "run", seed=0)
    out = plot_runs([tmp_path / "run"], tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    image = read_png(out)
    assert image.shape == (500, 800, 4)
    assert color_pixels(image, "C0") > 300  # the loss curve and the validation markers
    assert color_pixels(image, "C1") == 0


def test_two_runs_with_labels(tmp_path):
    write_run(tmp_path / "a", seed=1)
    write_run(tmp_path / "b", seed=2, steps=30)
    image = read_png(plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "loss.png",
                               labels=["dMoE", "dense"]))
    assert image.shape == (500, 800, 4)
    assert color_pixels(image, "C0") > 300 and color_pixels(image, "C1") > 300


def test_plot_runs_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "loss.png")
    write_run(tmp_path / "run", seed=0, steps=3)
    with pytest.raises(ValueError, match="labels"):
        plot_runs([tmp_path / "run"], tmp_path / "loss.png", labels=["a", "b"])
    with MetricsLogger(tmp_path / "no_loss", tensorboard=False, progress_bar="off") as logger:
        logger.log(1, {"lr": 1.0})
    with pytest.raises(ValueError, match="no_loss.*no finite 'loss'"):
        plot_runs([tmp_path / "no_loss"], tmp_path / "loss.png")


def test_expert_load_is_normalised_per_layer_at_every_step(tmp_path):
    """The fractions the heatmap draws (the last step's, or their mean with average=True)."""
    loads = write_run(tmp_path / "run", seed=3, steps=12, layers=3, experts=5)
    loads = np.asarray(loads, dtype=np.float64)
    expected = np.empty_like(loads)
    for s in range(loads.shape[0]):
        for layer in range(loads.shape[1]):
            expected[s, layer] = loads[s, layer] / loads[s, layer].sum()
    _, fractions = _load_fractions(tmp_path / "run", read_metrics(tmp_path / "run"))
    np.testing.assert_allclose(fractions, expected, rtol=1e-12)


def test_expert_load_heatmap(tmp_path):
    write_run(tmp_path / "run", seed=4, layers=4, experts=8)
    image = read_png(plot_expert_load(tmp_path / "run", tmp_path / "experts.png"))
    assert image.shape[1] == 1300 and image.shape[0] >= 400 and image.shape[2] == 4
    assert color_pixels(image, "C0") > 100 and color_pixels(image, "C3") > 100  # imbalance lines
    red, blue = image[..., 0] - image[..., 2], image[..., 2] - image[..., 0]
    assert (red > 0.3).sum() > 500 and (blue > 0.3).sum() > 500  # over- and under-loaded cells


def test_expert_load_errors(tmp_path):
    write_run(tmp_path / "dense", seed=5, steps=3)
    with pytest.raises(ValueError, match="no 'expert_load'"):
        plot_expert_load(tmp_path / "dense", tmp_path / "experts.png")
    with MetricsLogger(tmp_path / "ragged", tensorboard=False, progress_bar="off") as logger:
        logger.log(1, {"expert_load": [[1, 2, 3], [4, 5]]})
    with pytest.raises(ValueError, match="step 1: expert_load"):
        plot_expert_load(tmp_path / "ragged", tmp_path / "experts.png")


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_runs_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool().main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("RUN_DIR", "--out", "--labels", "--expert-load", "--average"):
        assert flag in out


@pytest.mark.slow
def test_tool_writes_plots(tmp_path, capsys):
    write_run(tmp_path / "moe", seed=6, steps=20, layers=2)
    write_run(tmp_path / "dense", seed=7, steps=20)
    tool = load_tool()
    assert tool.main([str(tmp_path / "moe"), str(tmp_path / "dense"), "--out",
                      str(tmp_path / "loss.png"), "--labels", "dMoE", "dense",
                      "--expert-load", str(tmp_path / "experts.png")]) == 0
    read_png(tmp_path / "loss.png")
    read_png(tmp_path / "experts-dMoE.png")
    assert not (tmp_path / "experts-dense.png").exists()
    assert "skipped" in capsys.readouterr().out
    assert tool.main([str(tmp_path / "moe"), "--out", str(tmp_path / "one.png"),
                      "--expert-load", str(tmp_path / "one-experts.png"), "--average"]) == 0
    read_png(tmp_path / "one-experts.png")


def test_tool_reports_errors_without_traceback(tmp_path, capsys):
    assert load_tool().main([str(tmp_path), "--out", str(tmp_path / "loss.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no metrics.jsonl in") and "Traceback" not in err
    with pytest.raises(SystemExit):
        load_tool().main([str(tmp_path), str(tmp_path), "--out", "x.png", "--labels", "one"])
    assert "--labels got 1 names for 2" in capsys.readouterr().err
