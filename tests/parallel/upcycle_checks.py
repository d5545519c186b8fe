"""Upcycling at expert-parallel size 2 (run in 2 gloo processes): each rank's experts are its share
of the dense MLP copies, and the model gives the dense model's loss."""
import torch
import torch.distributed as dist

from megatron_dmoe.config import load_config, resolve, validate
from megatron_dmoe.model.gpt import build_gpt_model
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.training.checkpoint import Progress, save_checkpoint
from megatron_dmoe.training.upcycle import upcycle_dense_checkpoint

VOCAB = 50
BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        "model.ffn_hidden_size=64", "model.add_bias_linear=false", "training.micro_batch_size=2",
        "training.global_batch_size=4"]


def _cfg(*overrides):
    cfg = resolve(load_config("tiny", BASE + list(overrides)))
    validate(cfg, world_size=dist.get_world_size())
    return cfg


def _loss(model):
    g = torch.Generator().manual_seed(dist.get_rank())  # different tokens per rank
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    model.eval()
    with torch.no_grad():
        return float(model(tokens[:, :-1], torch.arange(16).expand(2, 16), None, labels=tokens[:, 1:]).mean())


def check_upcycle_at_ep2(run_dir: str) -> None:
    torch.manual_seed(0)
    dense = build_gpt_model(_cfg("moe.num_experts=0"), vocab_size=VOCAB, on_cuda=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_checkpoint(f"{run_dir}/checkpoints", [dense], None, None, Progress(world_size=2), keep_last=1)
    expected = _loss(dense)

    init_distributed("cpu", expert_model_parallel_size=2)
    cfg = _cfg("moe.num_experts=4", "moe.top_k=4", "moe.ffn_hidden_size=32", "moe.upcycle_granularity=2",
               "moe.router_renormalize=true", "parallel.expert_model_parallel_size=2",
               f"checkpoint.upcycle_from={run_dir}")
    moe = build_gpt_model(cfg, vocab_size=VOCAB, on_cuda=False)
    upcycle_dense_checkpoint(cfg, [moe])
    fc1 = dense.decoder.layers[0].mlp.linear_fc1.weight
    experts = moe.decoder.layers[0].mlp.experts
    rank = dist.get_rank()
    assert experts.w1.shape[0] == 2  # this rank's experts 2 * rank, 2 * rank + 1: pieces 0 and 1
    assert torch.equal(experts.w1[0], fc1[:32]) and torch.equal(experts.w1[1], fc1[32:]), rank
    with torch.no_grad():  # uniform routing: every token on all 4 experts (2 copies of each piece), 1/4 each
        for layer in moe.decoder.layers:
            layer.mlp.router.weight.zero_()
    got = _loss(moe)
    assert abs(got - expected) < 1e-5, (rank, got, expected)
