"""The metrics tracker: what layers record, when, and what a snapshot returns."""
import os

import pytest
import torch

from megatron_dmoe.moe import MoELayer, MoEMetrics, MoERunState, load_balancing_loss, use_run_state, z_loss
from moe_reference import make_config


def test_snapshot_averages_losses_and_sums_loads():
    m = MoEMetrics()
    m.record(3, lb_loss=torch.tensor(0.2), z_loss=torch.tensor(0.02), tokens_per_expert=torch.tensor([4, 0, 2, 2]))
    m.record(3, lb_loss=torch.tensor(0.4), z_loss=torch.tensor(0.04), tokens_per_expert=torch.tensor([2, 2, 2, 2]))
    m.record(5, lb_loss=torch.tensor(0.1), tokens_per_expert=torch.tensor([1, 1, 1, 5]))
    snap = m.snapshot()
    layer3, layer5 = snap["layers"][3], snap["layers"][5]
    assert layer3["lb_loss"] == pytest.approx(0.3) and layer3["z_loss"] == pytest.approx(0.03)
    assert layer3["load"] == [6.0, 2.0, 4.0, 4.0] and layer3["load_imbalance"] == pytest.approx(6 / 4)
    assert "z_loss" not in layer5 and layer5["load_imbalance"] == pytest.approx(5 / 2)
    assert snap["lb_loss"] == pytest.approx((0.3 + 0.1) / 2)
    assert snap["z_loss"] == pytest.approx(0.03)
    assert snap["load_imbalance"] == pytest.approx((1.5 + 2.5) / 2)
    assert snap["load_imbalance_max"] == pytest.approx(2.5)
    m.reset()
    assert m.snapshot() == {}


def test_recorded_tensors_stay_detached_on_device():
    m = MoEMetrics()
    loss = torch.tensor(0.5, requires_grad=True) * 2
    m.record(1, lb_loss=loss, tokens_per_expert=torch.tensor([1, 2]))
    rec = m._layers[1]
    assert isinstance(rec.lb_sum, torch.Tensor) and not rec.lb_sum.requires_grad


def _layer(**extra):
    config = make_config(8, 8, 4, 2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, **extra)
    layer = MoELayer(config, backend="reference")
    layer.set_layer_number(2)
    return layer


def test_layer_records_training_forwards_only():
    layer = _layer()
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    tracker = layer.run_state.metrics
    layer.eval()
    layer(x)
    layer.train()
    with torch.no_grad():  # e.g. the first pass of full activation recompute
        layer(x)
    assert tracker.snapshot() == {}

    layer(x)
    layer(2 * x)
    snap = tracker.snapshot()["layers"][2]
    expected_lb, expected_z, expected_load = [], [], torch.zeros(4)
    for inp in (x, 2 * x):
        routing = layer.router(inp.view(-1, 8))
        expected_lb.append(load_balancing_loss(routing.scores, routing.tokens_per_expert, 2, 0.1).item())
        expected_z.append(z_loss(routing.logits, 0.01).item())
        expected_load += torch.bincount(routing.indices.flatten(), minlength=4)
    assert snap["lb_loss"] == pytest.approx(sum(expected_lb) / 2, rel=1e-12)
    assert snap["z_loss"] == pytest.approx(sum(expected_z) / 2, rel=1e-12)
    assert snap["load"] == expected_load.tolist() and sum(snap["load"]) == 2 * 12 * 2


def test_padding_tokens_are_not_counted():
    layer = _layer()
    layer.train()
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True  # the last two positions of sequence 1
    out, _ = layer(x, padding_mask=padding)
    load = layer.run_state.metrics.snapshot()["layers"][2]["load"]
    assert sum(load) == (10 - 2) * 2
    valid = ~padding.t().reshape(-1)
    routing = layer.router(x.view(-1, 8))
    expected = torch.bincount(routing.indices[valid].flatten(), minlength=4)
    assert load == expected.tolist()
    # padded tokens still get an output (dropless): the same as without a mask
    assert torch.equal(out, layer(x)[0])


def test_layers_share_the_run_state_they_are_given():
    config = make_config(8, 8, 4, 2, moe_aux_loss_coeff=0.1)
    own = [MoELayer(config, backend="reference") for _ in range(2)]
    # each layer alone has a state of its own; unnumbered layers get keys unique within a state
    assert own[0].run_state is not own[1].run_state
    state = MoERunState()
    given = [MoELayer(config, backend="reference", run_state=state) for _ in range(2)]
    model = torch.nn.ModuleList(own)
    assert use_run_state(model, state) is state
    layers = own + given
    assert all(layer.run_state is state and layer.experts.wgrad_stash is state.wgrad for layer in layers)
    assert sorted(layer.layer_number for layer in layers) == [-4, -3, -2, -1]
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    for layer in layers:
        layer.train()(x)
    snap = state.metrics.snapshot()
    assert sorted(snap["layers"]) == [-4, -3, -2, -1]
    assert all(sum(rec["load"]) == 3 * 2 * 2 for rec in snap["layers"].values())
    # a numbered layer keeps its number when it joins another state
    numbered = MoELayer(config, backend="reference", layer_number=5)
    numbered.use_run_state(MoERunState())
    assert numbered.layer_number == 5


def test_snapshot_all_reduces_over_a_group(tmp_path):
    import torch.distributed as dist

    # a one-process group: this process's own if an earlier test left one, else a fresh one
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        m = MoEMetrics()
        m.record(1, lb_loss=torch.tensor(0.5), tokens_per_expert=torch.tensor([3, 1]))
        snap = m.snapshot(group=dist.group.WORLD)
        assert snap["layers"][1] == {"lb_loss": 0.5, "load": [3.0, 1.0], "load_imbalance": 1.5}
    finally:
        if created:
            dist.destroy_process_group()
