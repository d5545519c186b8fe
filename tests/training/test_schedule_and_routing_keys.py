"""The keys behind Megatron-LM's --lr-decay-style WSD, --moe-router-load-balancing-type seq_aux_loss,
--moe-router-dtype and --rotary-percent, each against a reference written out here: the WSD learning
rate at every step from its formulas, the sequence-wise balance loss of a small case by hand, fp64
router logits from a float64 product, and the rotary dimensions megatron-core gets."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_dmoe.config import find_problems, load_config, resolve
from megatron_dmoe.config.environment import Environment
from megatron_dmoe.moe.aux_loss import sequence_load_balancing_loss
from megatron_dmoe.moe.options import MoEOptions
from megatron_dmoe.moe.router import TopKRouter
from megatron_dmoe.training.optim import build_scheduler

CPU = Environment(cuda=False, transformer_engine=False, apex=False)


def _wsd_reference(step, lr, min_lr, warmup, decay, wsd, style):
    """Megatron-LM's WSD: linear warmup from 0, lr until the last `wsd` steps of `decay`, then the style."""
    if step <= warmup:
        return lr * step / warmup
    if step > decay:
        return min_lr
    start = decay - wsd
    if step <= start:
        return lr
    r = (step - start) / wsd
    coeff = {"linear": 1 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1), "exponential": 2 * 0.5 ** r - 1,
             "minus_sqrt": 1 - math.sqrt(r)}[style]
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_learning_rate_at_every_step(style):
    cfg = resolve(load_config(None, ["training.train_iters=40", "training.lr_warmup_iters=5",
                                     "training.lr_decay_style=WSD", f"training.lr_wsd_decay_style={style}",
                                     "training.lr_wsd_decay_iters=12", "training.lr=0.002",
                                     "training.min_lr=0.0001"]))
    assert find_problems(cfg, world_size=1, env=CPU) == []
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    scheduler = build_scheduler(cfg, optimizer)
    for step in range(1, 46):
        scheduler.step(1)
        expected = _wsd_reference(step, 0.002, 0.0001, 5, 40, 12, style)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15), (step, style)


@pytest.mark.parametrize("changes, fragment", [
    (["training.lr_decay_style=WSD"], "is needed with training.lr_decay_style: WSD"),
    (["training.lr_decay_style=WSD", "training.lr_wsd_decay_iters=300"], "use at most 180"),
    (["training.lr_wsd_decay_iters=10"], "is used only with training.lr_decay_style: WSD"),
    (["training.lr_decay_style=WSD", "training.lr_wsd_decay_iters=10", "training.lr_wsd_decay_style=step"],
     "use one of: exponential, linear, cosine, minus_sqrt"),
])
def test_wsd_settings_are_checked(changes, fragment):
    problems = find_problems(resolve(load_config(None, changes)), world_size=1, env=CPU)
    assert any(fragment in message for _, message in problems), problems


def test_sequence_balance_loss_by_hand():
    """Two sequences of two tokens, two experts, top-1. Tokens in [s, b] order: t0 = (position 0,
    sequence 0), t1 = (0, 1), t2 = (1, 0), t3 = (1, 1).
    sequence 0 (t0, t2): picks e0, e0 -> f = [1, 0]; P = [(.8 + .6) / 2, (.2 + .4) / 2] = [.7, .3]; f.P = .7
    sequence 1 (t1, t3): picks e1, e0 -> f = [.5, .5]; P = [(.3 + .9) / 2, (.7 + .1) / 2] = [.6, .4]; f.P = .5
    loss = coeff * E * mean(.7, .5) = 0.01 * 2 * 0.6 = 0.012"""
    scores = torch.tensor([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)
    indices = torch.tensor([[0], [1], [0], [0]])
    loss = sequence_load_balancing_loss(scores, indices, num_sequences=2, top_k=1, coeff=0.01)
    assert loss.item() == pytest.approx(0.012, rel=1e-12)


def test_fp64_router_computes_its_logits_in_fp64():
    torch.manual_seed(0)
    options = dict(hidden_size=16, ffn_hidden_size=32, num_experts=8, top_k=2, router_impl="torch")
    router64 = TopKRouter(MoEOptions(**options, router_dtype="fp64"))
    router32 = TopKRouter(MoEOptions(**options))
    torch.nn.init.normal_(router64.weight)
    router32.weight.data.copy_(router64.weight.data)
    x = torch.randn(64, 16)
    exact = torch.nn.functional.linear(x.double(), router64.weight.double())
    r64, r32 = router64(x), router32(x)
    assert r64.weights.dtype == r64.scores.dtype == r64.logits.dtype == torch.float32
    assert torch.equal(r64.logits, exact.float())  # fp64 product, rounded once
    assert torch.equal(r64.indices, exact.topk(2, dim=-1).indices)
    assert torch.allclose(r32.logits, r64.logits, atol=1e-5)  # fp32 is close, not the same computation


def test_router_dtype_is_checked():
    problems = find_problems(resolve(load_config(None, ["moe.num_experts=4", "moe.router_dtype=bf16"])),
                             world_size=1, env=CPU)
    assert any(key == "moe.router_dtype" and "fp32, fp64" in m for key, m in problems), problems


@pytest.mark.parametrize("changes, fragment", [
    (["model.rotary_percent=0.5"], "applies to RoPE only"),
    (["model.position_embedding_type=rope", "model.rotary_percent=0.3"], "even whole number"),
    (["model.position_embedding_type=rope", "model.rotary_percent=0"], "out of range"),
])
def test_rotary_percent_is_checked(changes, fragment):
    problems = find_problems(resolve(load_config(None, changes)), world_size=1, env=CPU)
    assert any(fragment in message for _, message in problems), problems


def test_rotary_percent_rotates_that_share_of_each_head(cpu_dist):
    """head 32, 50 %: megatron-core's RoPE gets 16 dimensions (8 frequencies), and the model's output
    differs from whole-head RoPE with the same weights."""
    from megatron_dmoe.model.gpt import build_gpt_model

    base = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "moe.num_experts=0",
            "model.position_embedding_type=rope", "model.seq_length=16"]
    outputs = []
    for percent in (0.5, 1.0):
        cfg = resolve(load_config(None, [*base, f"model.rotary_percent={percent}"]))
        torch.manual_seed(0)
        model = build_gpt_model(cfg, vocab_size=50, on_cuda=False).eval()
        assert model.rotary_pos_emb.inv_freq.numel() == int(32 * percent) // 2
        tokens = torch.arange(16).remainder(50)[None]
        with torch.no_grad():
            outputs.append(model(tokens, torch.arange(16)[None], None))
    assert not torch.allclose(outputs[0], outputs[1])
