"""The training step's loss, grad norm and optimizer update against a float64 hand computation.

The model is a bigram table (logits = W[token] + b) under megatron's wrapper and our optimizer, so
the expected values need nothing but torch's float64 log-softmax: per micro-batch the masked mean
of -log p(label) over its unmasked tokens, the mean over micro-batches and data-parallel ranks, its
gradient, the clipped AdamW update. Run in one process or in every process of a gloo group (data
parallelism: each rank reads its own micro-batches; the reference sees every rank's).

Clipping fires at every step on every path: CLIP is well below the reference grad norms (one
process and two ranks alike), and Adam's eps is large enough next to these gradients that the
update depends on the clipped gradient's size, not only on its direction, so a wrong clip factor
(a grad norm over one rank's shard of the distributed optimizer, say) moves the weights far past
the tolerance.
"""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from megatron_dmoe.config import load_config, resolve
from megatron_dmoe.moe.run_state import MoERunState
from megatron_dmoe.training.optim import build_optimizer, build_scheduler
from megatron_dmoe.training.setup import release_after_training, wrap_for_training
from megatron_dmoe.training.step import evaluate, mean_over_data_parallel, train_step

VOCAB, SEQ, MICRO_BATCH, NUM_MICRO, STEPS = 11, 6, 2, 3, 2
LR, WD, BETA1, BETA2, EPS, CLIP = 0.05, 0.1, 0.9, 0.95, 1e-3, 0.25
CLIPPED_BELOW = 0.6  # every reference grad norm is at least CLIP / this: the clip factor at most 0.6
WEIGHT_ATOL = 1e-6  # fp32 model and optimizer against float64: a few ulps of fp32


class Bigram(MegatronModule):
    """Per-token losses [batch, seq] from logits W[token] + b, as the GPT model returns them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__(TransformerConfig(num_layers=1, hidden_size=VOCAB, num_attention_heads=1))
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(weight.float().clone())
        self.bias = torch.nn.Parameter(bias.float().clone())

    def set_input_tensor(self, tensor):
        pass

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        logits = self.weight[tokens] + self.bias
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(labels.shape)


def initial_weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64), torch.randn(VOCAB, generator=g,
                                                                                    dtype=torch.float64)


def micro_batch(step: int, rank: int, index: int, train: bool = True) -> dict:
    """A micro-batch whose loss mask leaves out a different number of tokens in each row (padding),
    one row of one micro-batch entirely: the masked mean must divide by the unmasked count."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + 10 * index + int(train))
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    mask = torch.ones(MICRO_BATCH, SEQ)
    for row in range(MICRO_BATCH):
        mask[row, SEQ - (row + index + rank + step) % SEQ:] = 0  # 0 to SEQ - 1 padding tokens
    if index == 1:
        mask[0] = 0  # a row without a token to count
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}


def reference_loss(weight, bias, batch) -> torch.Tensor:
    """float64: the mean of -log softmax(W[token] + b)[label] over the unmasked tokens."""
    logp = torch.log_softmax(weight[batch["tokens"]] + bias, dim=-1)
    nll = -logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    mask = batch["loss_mask"].double()
    return (nll * mask).sum() / mask.sum()


def reference_step_loss(step: int, rank: int, weights) -> float:
    """This rank's share alone: the mean of its micro-batches' masked means (what train_step returns
    before the loop averages it over data-parallel ranks)."""
    return torch.stack([reference_loss(*weights, micro_batch(step, rank, i)) for i in range(NUM_MICRO)]).mean().item()


def _global_batch_loss(weight, bias, step, ranks, train=True):
    """Mean over ranks and micro-batches of the micro-batches' masked means."""
    losses = [reference_loss(weight, bias, micro_batch(step, r, i, train)) for r in range(ranks) for i in
              range(NUM_MICRO)]
    return torch.stack(losses).mean()


def reference_run(ranks: int, clip: float | None = CLIP):
    """(per-step losses, per-step grad norms, final weight, final bias, validation loss) by hand;
    clip None: no clipping."""
    weight, bias = (t.clone().requires_grad_() for t in initial_weights())
    exp_avg = [torch.zeros_like(weight), torch.zeros_like(bias)]
    exp_avg_sq = [torch.zeros_like(weight), torch.zeros_like(bias)]
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        loss = _global_batch_loss(weight, bias, step, ranks)
        grads = torch.autograd.grad(loss, [weight, bias])
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        losses.append(loss.item())
        norms.append(norm.item())
        coefficient = clip / (norm + 1e-6) if clip is not None else 1.0
        with torch.no_grad():
            for i, (p, g, decay) in enumerate(zip((weight, bias), grads, (WD, 0.0))):  # no decay on 1-D
                g = g * coefficient if coefficient < 1 else g
                p.mul_(1 - LR * decay)
                exp_avg[i] = BETA1 * exp_avg[i] + (1 - BETA1) * g
                exp_avg_sq[i] = BETA2 * exp_avg_sq[i] + (1 - BETA2) * g * g
                m_hat = exp_avg[i] / (1 - BETA1 ** step)
                v_hat = exp_avg_sq[i] / (1 - BETA2 ** step)
                p.sub_(LR * m_hat / (v_hat.sqrt() + EPS))
    with torch.no_grad():
        val = torch.stack([_global_batch_loss(weight, bias, b, ranks, train=False) for b in (1, 2)]).mean()
    return losses, norms, weight.detach(), bias.detach(), val.item()


def _config(use_distributed_optimizer: bool):
    return resolve(load_config(None, [
        f"training.lr={LR}", f"training.weight_decay={WD}", f"training.adam_beta1={BETA1}",
        f"training.adam_beta2={BETA2}", f"training.adam_eps={EPS}", f"training.clip_grad={CLIP}",
        "training.lr_decay_style=constant", "training.lr_warmup_iters=0", f"training.train_iters={STEPS}",
        "training.device=cpu", f"training.use_distributed_optimizer={str(use_distributed_optimizer).lower()}"]))


def run_steps(use_distributed_optimizer: bool = False):
    """Train STEPS steps and evaluate two batches through step.py on this rank's micro-batches;
    returns (losses, grad norms, weight, bias, validation loss) as the reference does."""
    rank = ps.get_data_parallel_rank()
    cfg = _config(use_distributed_optimizer)
    model = wrap_for_training(Bigram(*initial_weights()), use_distributed_optimizer)
    optimizer = build_optimizer(cfg, [model], on_cuda=False)
    scheduler = build_scheduler(cfg, optimizer)  # as the loop: the groups' lr and weight decay
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        weight_before = [p.detach().double().clone() for p in (model.module.weight, model.module.bias)]
        data = iter([micro_batch(step, rank, i) for i in range(NUM_MICRO)])
        loss, norm, applied = train_step(model, optimizer, data, NUM_MICRO, torch.device("cpu"), MoERunState())
        assert applied
        own = reference_step_loss(step, rank, weight_before)
        assert abs(loss.item() - own) <= 1e-6 * own, ("this rank's loss", step, loss.item(), own)
        losses.append(mean_over_data_parallel(loss))  # as the loop logs it
        norms.append(norm)
        scheduler.step(1)
    data = iter([micro_batch(b, rank, i, train=False) for b in (1, 2) for i in range(NUM_MICRO)])
    val = evaluate(model, data, 2, NUM_MICRO, torch.device("cpu"))
    weight, bias = model.module.weight.detach().clone(), model.module.bias.detach().clone()
    release_after_training([model])
    return losses, norms, weight, bias, val


def check_against_reference(use_distributed_optimizer: bool = False):
    """Every rank's steps equal the hand computation over all data-parallel ranks' micro-batches."""
    losses, norms, weight, bias, val = run_steps(use_distributed_optimizer)
    ranks = ps.get_data_parallel_world_size()
    ref_losses, ref_norms, ref_weight, ref_bias, ref_val = reference_run(ranks)
    # the clip fires at every step, and the weights show it: unclipped, they end far from the clipped
    # reference (so the comparison below fails if the run skips or misapplies the clip)
    assert all(CLIP <= CLIPPED_BELOW * norm for norm in ref_norms), (CLIP, ref_norms)
    _, _, free_weight, free_bias, _ = reference_run(ranks, clip=None)
    unclipped_off = max((free_weight - ref_weight).abs().max(), (free_bias - ref_bias).abs().max()).item()
    assert unclipped_off > 100 * WEIGHT_ATOL, unclipped_off
    for got, want, what in ((losses, ref_losses, "loss"), (norms, ref_norms, "grad norm")):
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (what, got, want)
    assert abs(val - ref_val) <= 1e-6 * abs(ref_val), ("validation loss", val, ref_val)
    torch.testing.assert_close(weight.double(), ref_weight, rtol=0, atol=WEIGHT_ATOL)
    torch.testing.assert_close(bias.double(), ref_bias, rtol=0, atol=WEIGHT_ATOL)


def check_with_both_optimizers():
    """check_against_reference with megatron's Adam, then with its distributed optimizer."""
    for use_distributed_optimizer in (False, True):
        check_against_reference(use_distributed_optimizer)
