"""Nothing that validates fails later, and every layout trains as one process does: every parallel
layout validation accepts for a dense and an MoE model at 2, 4 and 8 CPU processes trains STEPS
steps (layout_checks; one spawned group per world size) with the losses and grad norms of one
process to 1e-5 at every step, experts split over expert-tensor-parallel ranks included; after
PP 2 x TP 2 x DP 2 x EP 2 with the distributed optimizer, every parameter equals one process's. The
layouts validation refuses include every context-parallel one."""
import json

import pytest
import torch

from layout_checks import (
    PARAMETERS_CHECKED,
    PARAMETERS_CHECKED_BATCH,
    TRAINED_PIPELINES_UP_TO,
    layouts,
    train_accepted_layouts,
    train_one_process,
)
from process_group import run_in_processes

CHECKED_MODEL = ("moe-every-layer", PARAMETERS_CHECKED_BATCH)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_cache):
    """one_process(kind, global batch size): the one-process run's logged steps, trained once for
    all world sizes; .run_dir(kind, global batch size) its run directory."""
    root = tmp_path_factory.mktemp("one_process")
    done = {}

    def run_dir(kind, global_batch_size):
        return root / f"{kind}-gbs{global_batch_size}"

    def steps(kind, global_batch_size):
        key = (kind, global_batch_size)
        if key not in done:
            done[key] = train_one_process(kind, global_batch_size, corpus_cache, run_dir(*key),
                                          save=key == CHECKED_MODEL)
        return done[key]

    steps.run_dir = run_dir
    return steps


def _parameters(run_dir):
    """Every parameter of the run's last checkpoint, loaded into one process's model."""
    from megatron_dmoe.inference.run_model import load_run
    from megatron_dmoe.parallel.distributed import destroy_distributed

    run = load_run(run_dir, device="cpu")
    try:
        return {name: p.detach().clone() for name, p in run.model.named_parameters()}
    finally:
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_accepted_layout_trains_as_one_process(tmp_path, corpus_cache, one_process, world_size):
    candidates = layouts(world_size, corpus_cache)
    configs = {name: cfg for name, cfg, problems in candidates if not problems}
    accepted = list(configs)
    summary = tmp_path / "summary.json"
    run_in_processes(world_size, train_accepted_layouts, str(tmp_path / "runs"), corpus_cache, str(summary),
                     list(configs.items()), timeout=1400)
    result = json.loads(summary.read_text())
    assert not any("-cp2-" in name for name in accepted), accepted
    assert not any(name.startswith("dense") and "-etp2-" in name for name in accepted), accepted
    expected = [name for name in accepted if world_size <= TRAINED_PIPELINES_UP_TO or name.endswith("-pp1")]
    assert sorted(result["trained"]) == sorted(expected), (result["trained"], expected)
    # layouts composed of every supported axis are among them
    assert f"moe-tp2-sp1-ep{world_size}-etp1-cp1-pp1" in expected
    assert f"moe-tp2-sp1-ep{world_size // 2}-etp2-cp1-pp1" in expected
    if world_size == 4:
        assert "moe-tp2-sp1-ep2-etp1-cp1-pp2" in expected
        assert "moe-tp2-sp1-ep1-etp2-cp1-pp2" in expected
    if world_size == 8:
        assert {"moe-tp4-sp1-ep8-etp1-cp1-pp1", "dense-tp4-sp1-ep1-etp1-cp1-pp1"} <= set(expected)
        result["trained"][PARAMETERS_CHECKED] = result[PARAMETERS_CHECKED]

    # the same samples and initial weights: only the order of fp32 sums differs
    far = {}
    for name in result["trained"]:
        if name == PARAMETERS_CHECKED:
            reference = one_process(*CHECKED_MODEL)
        else:
            reference = one_process(name.split("-")[0], configs[name].training.global_batch_size)
        for key in ("loss", "grad_norm"):
            for step, (got, want) in enumerate(zip(result["trained"][name][key], reference[key]), start=1):
                if not abs(got - want) <= 1e-5 * abs(want):
                    far[f"{name} step {step} {key}"] = (got, want)
    assert not far, far

    if world_size == 8:
        got = _parameters(tmp_path / "runs" / PARAMETERS_CHECKED)
        want = _parameters(one_process.run_dir(*CHECKED_MODEL))
        assert sorted(got) == sorted(want)
        # Adam moves a weight by up to lr (1e-3) a step whatever its gradient's size: where a gradient
        # is near Adam's eps, fp32 sums in another order move it by a few 1e-6 (a weight from the wrong
        # shard or rank, or a missed update, is off by 1e-3 or more)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
