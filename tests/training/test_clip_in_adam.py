"""Gradient clipping folded into torch's fused Adam (training/clip_in_adam.py): the same update as
megatron-core's clip-then-step, checked on CPU against a stand-in with megatron's optimizer interface
(torch's fused AdamW runs on CPU too) and on a GPU with megatron-core's own optimizer."""
import types

import pytest
import torch

from megatron_dmoe.training.clip_in_adam import fold_clip_into_adam


class _MegatronLike:
    """megatron-core's optimizer interface around one torch optimizer: prepare, norm, inner step,
    and its own step (clip by scaling every gradient, then step) as the reference."""

    def __init__(self, inner, clip):
        self.optimizer = inner
        self.config = types.SimpleNamespace(clip_grad=clip, log_num_zeros_in_grad=False)
        self.steps_with_ready_grads = 0

    def params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def prepare_grads(self):
        return False

    def get_grad_norm(self):
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params()])))

    def step_with_ready_grads(self):
        self.steps_with_ready_grads += 1
        self.optimizer.step()
        return True

    def step(self):
        norm = self.get_grad_norm()
        coefficient = self.config.clip_grad / (norm + 1.0e-6)
        if coefficient < 1.0:
            for p in self.params():
                p.grad.mul_(coefficient)
        return self.step_with_ready_grads(), norm, None


def _pair(clip, grad_size, fused=True):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(33, 17, generator=g), torch.randn(50, generator=g)]
    grads = [grad_size * torch.randn(w.shape, generator=g) for w in weights]
    out = []
    for _ in range(2):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
        out.append(_MegatronLike(inner, clip))
    return out


@pytest.mark.parametrize("grad_size", [10.0, 1e-3], ids=["clipped", "below-the-clip"])
def test_folded_clip_updates_as_clip_then_step(grad_size):
    reference, folded = _pair(clip=1.0, grad_size=grad_size)
    assert fold_clip_into_adam(folded)
    for _ in range(3):  # the moments carry the clipped gradients from step to step
        ok, norm, _ = folded.step()
        ok_ref, norm_ref, _ = reference.step()
        assert ok and ok_ref and norm == pytest.approx(norm_ref)
        assert not hasattr(folded.optimizer, "grad_scale")  # nothing left for the next step
        for p, q in zip(folded.params(), reference.params()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        for opt in (folded, reference):
            for p in opt.params():
                p.grad = torch.full_like(p, grad_size)


def test_other_optimizers_keep_their_own_step():
    unfused, _ = _pair(clip=1.0, grad_size=1.0, fused=False)
    no_clip, _ = _pair(clip=0.0, grad_size=1.0)
    for opt in (unfused, no_clip):
        step = opt.step
        assert not fold_clip_into_adam(opt) and opt.step == step


@pytest.mark.gpu
def test_megatron_optimizer_with_the_folded_clip_matches_its_own_step():
    """Two copies of a small bf16 dMoE GPT under megatron-core's optimizer and DDP, the same large
    gradients in main_grad: one step with megatron's clip, one with the clip folded into fused Adam."""
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything
    from megatron_dmoe.training import optim
    from megatron_dmoe.training.setup import wrap_for_training

    env = init_distributed("cuda")
    try:
        cfg = resolve(load_config(None, ["model.hidden_size=64", "moe.num_experts=4", "moe.top_k=1",
                                         "moe.ffn_hidden_size=128", "model.num_layers=2", "training.bf16=true",
                                         "training.clip_grad=1.0"]))
        runs = []
        for fold in (False, True):
            seed_everything(1234, env)
            model = wrap_for_training(build_gpt_model(cfg, vocab_size=1000, on_cuda=True))
            opt = optim.build_optimizer(cfg, [model], on_cuda=True)
            if not fold:
                opt.step = type(opt).step.__get__(opt)  # megatron's own step
            g = torch.Generator(device="cuda").manual_seed(7)
            norms = []
            for scale in (1.0, 30.0):  # two clip factors: Adam's moments then mix differently clipped steps
                for p in model.parameters():
                    p.main_grad.copy_(scale * torch.randn(p.shape, generator=g, device="cuda"))
                applied, norm, _ = opt.step()
                assert applied
                norms.append(norm)
            runs.append((norms, [p.detach().float().clone() for p in model.parameters()]))
        (n0, p0), (n1, p1) = runs
        assert n0 == pytest.approx(n1) and min(n0) > 10.0  # both steps clipped
        # the bf16 model weights: equal to a rounding of the fp32 masters, which differ by fp32 rounding
        for x, y in zip(p0, p1):
            assert torch.allclose(x, y, rtol=1e-2, atol=1e-6)
    finally:
        destroy_distributed()
