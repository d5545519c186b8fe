"""megatron-core's own forward-backward schedule drives the layer: the router's aux-loss gradient is
scaled as megatron-core scales its own MoE's (the scale its schedule sets on MoEAuxLossAutoScaler
every micro-batch), and the aux losses and expert loads land in megatron-core's aux-loss tracker,
where Megatron-LM's training loop reads them."""
import contextlib
import math

import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

from megatron_dmoe.compat.mcore import aux_loss_tracker_values, clear_aux_loss_tracker
from megatron_dmoe.moe import MoELayer
from megatron_dmoe.moe.aux_loss import AuxLossScaler
from moe_reference import make_config

AUX, ZLOSS = 0.1, 0.05
NUM_MICRO, SEQ, BATCH, HIDDEN = 3, 5, 2, 8
FP16_LOSS_SCALE = 8.0  # what megatron's grad_scale_func multiplies the loss by under fp16


class _OneLayerModel(MegatronModule):
    """The smallest model megatron's schedule accepts: config, model_type, set_input_tensor."""

    def __init__(self, config):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.moe = MoELayer(config, backend="reference")
        self.moe.set_layer_number(2)

    def set_input_tensor(self, tensor):
        pass

    def forward(self, x):
        return self.moe(x)[0]


@contextlib.contextmanager
def _schedule_on_cpu():
    """megatron's schedule counts tokens in a tensor made on 'cuda' (facts: GPU-only on CPU)."""
    zeros = torch.zeros

    def cpu_zeros(*args, device=None, **kwargs):
        return zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.zeros = cpu_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


def _micro_batches():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64) for _ in range(NUM_MICRO)]
    targets = [torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64) for _ in range(NUM_MICRO)]
    return xs, targets


def _main_loss(out, target):
    return (out * target).sum() / out.numel()


def _expected_router_grad(layer, xs, targets):
    """By hand: d/dW of (loss_scale / N) * sum over micro-batches of (main loss + lb loss + z loss),
    the aux losses written out from the router's scores (Switch form, ST-MoE z-loss)."""
    opts = layer.options
    saved = opts.aux_loss_coeff, opts.z_loss_coeff
    opts.aux_loss_coeff = opts.z_loss_coeff = 0.0  # the layer's forward adds no aux gradient now
    try:
        layer.zero_grad()
        total = 0.0
        lb_values, z_values, imbalances = [], [], []
        for x, target in zip(xs, targets):
            flat = x.reshape(-1, HIDDEN)
            routing = layer.router(flat, None)
            probs = routing.scores
            T, E = probs.shape
            f = routing.tokens_per_expert.double() / (T * opts.top_k)
            lb = AUX * E * torch.sum(f * probs.mean(dim=0))
            z = ZLOSS * torch.logsumexp(routing.logits, dim=-1).square().mean()
            lb_values.append(lb.item())
            z_values.append(z.item())
            load = routing.tokens_per_expert.double()
            imbalances.append((load.max() / load.mean()).item())  # max / mean tokens per expert
            out = layer(x)[0]
            total = total + _main_loss(out, target) + lb + z
        (total * FP16_LOSS_SCALE / NUM_MICRO).backward()
        return layer.router.weight.grad.clone(), lb_values, z_values, imbalances
    finally:
        opts.aux_loss_coeff, opts.z_loss_coeff = saved
        layer.zero_grad()


@pytest.fixture
def fresh_megatron_scale():
    """megatron-core keeps its aux-loss scale on a class; an earlier test's backward may have left a
    0-dim one there, which its schedule's [1]-shaped scale cannot be copied into. Start as a fresh
    Megatron-LM process does (no scale yet) and put the old state back afterwards."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def test_megatron_schedule_scales_the_aux_loss_gradient_like_megatron_core(cpu_dist, fresh_megatron_scale):
    config = make_config(HIDDEN, 12, 4, 2, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=ZLOSS)
    config.num_layers = 3  # the layer is number 2 of 3: megatron's tracker is indexed by global layer
    config.grad_scale_func = lambda loss: loss * FP16_LOSS_SCALE
    model = _OneLayerModel(config)
    xs, targets = _micro_batches()
    expected, lb_values, z_values, imbalances = _expected_router_grad(model.moe, xs, targets)

    def forward_step(data_iterator, model):
        x, target = next(data_iterator)
        out = model(x)
        return out, lambda output: (_main_loss(output, target), {"loss": _main_loss(output, target).detach()})

    clear_aux_loss_tracker()
    # an entry an earlier one-layer model left in this process's tracker
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 1, 1)
    model.moe.run_state.metrics.reset()  # drop what the reference forwards recorded
    AuxLossScaler.set_loss_scale(1.0)
    try:
        with _schedule_on_cpu():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(list(zip(xs, targets))), model=[model],
                num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
            )
        got = model.moe.router.weight.grad
        # the old separate scaler (scale 1) gave the aux part N x FP16_LOSS_SCALE^-1 of this
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)  # the scale is fp32

        # megatron-core's tracker: per unit coefficient, summed over micro-batches, at global layer 2
        tracker = aux_loss_tracker_values()
        lb_track = tracker["load_balancing_loss"]
        assert lb_track.shape == (3,) and lb_track[0] == 0 and lb_track[2] == 0
        assert lb_track[1].item() == pytest.approx(sum(lb_values) / AUX, rel=1e-6)  # megatron keeps fp32
        assert tracker["z_loss"][1].item() == pytest.approx(sum(z_values) / ZLOSS, rel=1e-6)
        imbalance = tracker["expert_load_imbalance"][1].item() / NUM_MICRO
        assert imbalance == pytest.approx(sum(imbalances) / NUM_MICRO, rel=1e-6), imbalances
        # our own metrics: coefficient-weighted means over the micro-batches, loads summed
        snap = model.moe.run_state.metrics.snapshot()["layers"][2]
        assert snap["lb_loss"] == pytest.approx(sum(lb_values) / NUM_MICRO, rel=1e-10)
        assert snap["z_loss"] == pytest.approx(sum(z_values) / NUM_MICRO, rel=1e-10)
        assert sum(snap["load"]) == NUM_MICRO * SEQ * BATCH * 2
        assert not math.isnan(snap["load_imbalance"])
    finally:
        AuxLossScaler.set_loss_scale(1.0)
        clear_aux_loss_tracker()
