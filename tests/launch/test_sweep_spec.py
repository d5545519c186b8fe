"""Sweep files: parsing, expansion into runs (grid x zip), run names, and every mistake reported
before anything happens."""
import itertools
from pathlib import Path

import pytest

from megatron_dmoe.config import Environment, load_config, resolve
from megatron_dmoe.sweep import SweepError, expand, load_sweep, plan_runs, write_runs
from megatron_dmoe.sweep.points import MAX_NAME_LENGTH, point_name

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
SHIPPED_SWEEPS = sorted((CONFIGS_DIR / "sweeps").glob("*.yaml"))


def _sweep(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_grid_is_a_product_and_zip_walks_its_lists_together(tmp_path):
    spec = load_sweep(_sweep(tmp_path, """
base: tiny
overrides: {training.train_iters: 7}
grid:
  moe.top_k: [1, 2]
  moe.num_experts: [4, 8, 16]
zip:
  training.lr: [1.0e-3, 2.0e-3]
  training.min_lr: [1.0e-4, 2.0e-4]
"""))
    points = expand(spec)
    expected = [
        {"moe.top_k": k, "moe.num_experts": e, "training.lr": lr, "training.min_lr": mlr}
        for k, e, (lr, mlr) in itertools.product([1, 2], [4, 8, 16], [(1e-3, 1e-4), (2e-3, 2e-4)])
    ]
    assert [p.values for p in points] == expected
    assert [p.index for p in points] == list(range(12))
    assert points[0].name == "top_k=1,num_experts=4,lr=0.001,min_lr=0.0001"
    assert len({p.name for p in points}) == 12


def test_each_run_config_is_the_base_with_the_overrides_and_its_values(tmp_path):
    spec = load_sweep(_sweep(tmp_path, """
base: tiny
overrides: {training.train_iters: 70, logging.plot: false}
grid: {moe.top_k: [1, 2]}
"""))
    planned = plan_runs(spec, tmp_path / "runs", Environment.detect())
    for run, top_k in zip(planned, (1, 2)):
        want = resolve(load_config("tiny", ["training.train_iters=70", "logging.plot=false",
                                            f"moe.top_k={top_k}"]))
        assert run.config == want
        assert run.run_dir == tmp_path / "runs" / f"top_k={top_k}"
    assert not (tmp_path / "runs").exists()  # planning writes nothing


def test_base_is_found_beside_the_sweep_file(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: tiny\nmoe: {top_k: 1}\n")
    spec = load_sweep(_sweep(tmp_path, "base: mine.yaml\n"))
    assert spec.base == (tmp_path / "mine.yaml").resolve()
    [point] = expand(spec)
    assert point.name == "sweep" and point.values == {}


def test_names_are_safe_directory_names():
    labels = {"data.data_path": "data_path", "model.ffn_hidden_size": "model.ffn_hidden_size"}
    name = point_name({"data.data_path": ["0.3", "/data/a b", "0.7", "c"],
                       "model.ffn_hidden_size": None}, labels, "x")
    assert name == "data_path=0.3+-data-a-b+0.7+c,model.ffn_hidden_size=null"
    long = point_name({"data.data_path": ["x" * 300]}, {"data.data_path": "p"}, "x")
    assert len(long) == MAX_NAME_LENGTH and long.startswith("p=xxx")
    assert long != point_name({"data.data_path": ["x" * 301]}, {"data.data_path": "p"}, "x")
    assert point_name({"training.lr": -0.5}, {"training.lr": "lr"}, "x") == "lr=-0.5"


def test_keys_with_the_same_name_in_two_sections_keep_their_section(tmp_path):
    spec = load_sweep(_sweep(tmp_path, """
base: tiny
zip: {model.ffn_hidden_size: [256, 512], moe.ffn_hidden_size: [128, 256]}
"""))
    assert [p.name for p in expand(spec)] == [
        "model.ffn_hidden_size=256,moe.ffn_hidden_size=128",
        "model.ffn_hidden_size=512,moe.ffn_hidden_size=256",
    ]


@pytest.mark.parametrize("text, messages", [
    ("base: tiny\ngird: {moe.top_k: [1, 2]}\n", ["gird: unknown key; did you mean grid?"]),
    ("base: tiny\ngrid: {moe.topk: [1, 2]}\n",
     ["grid: moe.topk: unknown key; did you mean moe.top_k?"]),
    ("base: tiny\nzip: {trainig.lr: [1.0e-3]}\n",
     ["zip: trainig.lr: unknown section; did you mean training?"]),
    ("base: tiny\noverrides: {train_iters: 5}\n",
     ["overrides: train_iters: a key must look like section.key"]),
    ("base: tiny\ngrid: {moe.top_k: []}\n", ["grid: moe.top_k: empty list"]),
    ("base: tiny\ngrid: {moe.top_k: 2}\n", ["grid: moe.top_k: expected a list of values"]),
    ("base: tiny\nzip: {training.lr: [1.0e-3, 2.0e-3], training.min_lr: [1.0e-4]}\n",
     ["zip: the lists have different lengths (training.lr has 2, training.min_lr has 1)"]),
    ("base: tiny\ngrid: {moe.top_k: [1]}\nzip: {moe.top_k: [2]}\n",
     ["moe.top_k: is in both grid and zip"]),
    ("base: tiny\noverrides: {moe.top_k: 1}\ngrid: {moe.top_k: [1, 2]}\n",
     ["moe.top_k: is set in overrides and varied in grid"]),
    ("grid: {moe.top_k: [1]}\n", ["base: missing"]),
    ("base: no_such_config\n", ["base: config 'no_such_config' not found"]),
    ("base: tiny\nslurm: {array: 0-3}\n", ["slurm: array: is set by dmoe-sweep"]),
    ("base: tiny\ngrid: {moe.top_k: [1, 1]}\n", ["top_k=1: two runs get this directory name"]),
    ("- base\n", ["expected a mapping with base:"]),
    ("base: tiny\ngrid: {moe.topk: [1], moe.top_k: []}\nwhat: 1\n",
     ["(3 problems)", "what: unknown key", "moe.topk: unknown key", "moe.top_k: empty list"]),
])
def test_mistakes_in_the_file_are_reported_together(tmp_path, text, messages):
    path = _sweep(tmp_path, text)
    with pytest.raises(SweepError) as err:
        expand(load_sweep(path))
    assert str(err.value).startswith(f"invalid sweep {path}")
    for message in messages:
        assert message in str(err.value)


def test_invalid_values_name_the_runs_they_concern(tmp_path):
    spec = load_sweep(_sweep(tmp_path, "base: tiny\ngrid: {moe.top_k: [2, 16, two]}\n"))
    with pytest.raises(SweepError) as err:
        plan_runs(spec, tmp_path / "runs", Environment.detect())
    text = str(err.value)
    assert "(2 problems)" in text
    assert "moe.top_k: 16 is larger than moe.num_experts (8)" in text and "(run top_k=16)" in text
    assert "moe.top_k: expected an integer, got 'two' (run top_k=two)" in text
    assert "top_k=2)" not in text


def test_a_problem_of_every_run_is_listed_once(tmp_path):
    spec = load_sweep(_sweep(tmp_path, """
base: tiny
overrides: {training.lr_decay_iters: 5}
grid: {moe.top_k: [1, 2]}
"""))
    with pytest.raises(SweepError) as err:
        plan_runs(spec, tmp_path / "runs", Environment.detect())
    assert str(err.value).count("training.lr_decay_iters") == 1
    assert "(every run)" in str(err.value)


def test_gpu_sweeps_are_checked_for_gpu_nodes(tmp_path):
    spec = load_sweep(CONFIGS_DIR / "sweeps" / "xs_dmoe_vs_capacity.yaml")
    with pytest.raises(SweepError, match="training.bf16: true needs CUDA"):
        plan_runs(spec, tmp_path / "runs", Environment(cuda=False, transformer_engine=False,
                                                       apex=False))
    planned = plan_runs(spec, tmp_path / "runs", Environment.everything())
    factors = [(r.config.moe.num_experts, r.config.moe.expert_capacity_factor) for r in planned]
    assert factors == [(64, None), (64, 1.0), (64, 1.5), (64, 2.0), (0, None)]


def test_the_settings_sweep_crosses_the_aux_coefficient_with_the_learning_rates(tmp_path):
    spec = load_sweep(CONFIGS_DIR / "sweeps" / "settings_xs.yaml")
    planned = plan_runs(spec, tmp_path / "runs", Environment.everything())
    values = [(r.config.moe.aux_loss_coeff, r.config.training.lr, r.config.training.min_lr) for r in planned]
    assert values == [(c, lr, low) for c in (0.001, 0.01, 0.03) for lr, low in ((6.0e-4, 6.0e-5), (1.2e-3, 1.2e-4))]
    assert {r.config.training.time_limit_minutes for r in planned} == {4}


def test_a_run_directory_of_another_config_is_refused(tmp_path):
    spec = load_sweep(_sweep(tmp_path, "base: tiny\ngrid: {moe.top_k: [1, 2]}\n"))
    env = Environment.detect()
    write_runs(spec, plan_runs(spec, tmp_path / "runs", env), tmp_path / "runs")
    assert len(plan_runs(spec, tmp_path / "runs", env)) == 2  # the same sweep again: fine
    changed = load_sweep(_sweep(tmp_path, "base: tiny\noverrides: {training.lr: 0.01}\n"
                                          "grid: {moe.top_k: [1, 2]}\n"))
    with pytest.raises(SweepError, match=r"an earlier run with another config is there "
                                         r"\(training.lr: 0.002 -> 0.01\)"):
        plan_runs(changed, tmp_path / "runs", env)


@pytest.mark.parametrize("path", SHIPPED_SWEEPS, ids=lambda p: p.name)
def test_shipped_sweeps_expand_and_validate_for_gpu_nodes(path, tmp_path):
    planned = plan_runs(load_sweep(path), tmp_path / "runs", Environment.everything())
    assert len(planned) >= 4
