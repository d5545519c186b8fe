"""Checks run in every process of a 2-process gloo group (see process_group.run_in_processes):
tensor (and sequence) parallelism, alone, with expert parallelism folded over the tensor group and
with the experts split over it (expert tensor parallelism), gives one process's gradients.

Per case, in float64: the whole GPT model at tensor-parallel size 1 (every rank alone, the same
batch) is the reference; the same model at the case's layout, built from the same seed (megatron
initialises the full weights on the CPU and keeps this rank's slice), runs the same batch through
megatron's DDP and finalize_model_grads, as training does. Every parameter's reduced gradient must
equal its slice of the reference gradient: split weights along their partition dimension, experts
by their expert-parallel layout, replicated ones whole (router, shared experts and norms see only
their sequence shard under SP, so this also checks their sum over the tensor group). The global
gradient norm (clipping) equals the reference's on every rank.
"""
import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_dmoe.config import load_config, resolve, validate
from megatron_dmoe.config.environment import megatron_core_release
from megatron_dmoe.model.gpt import build_gpt_model
from megatron_dmoe.moe import update_expert_biases
from megatron_dmoe.moe.aux_loss import set_aux_loss_scale
from megatron_dmoe.moe.experts import ExpertMLP
from megatron_dmoe.parallel.distributed import init_distributed, seed_everything
from megatron_dmoe.parallel.param_roles import is_expert_parallel
from megatron_dmoe.training.optim import global_grad_norm

VOCAB = 200  # padded to 256 at tensor-parallel sizes 1 and 2
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
         "model.max_position_embeddings=16", "model.ffn_hidden_size=64", "model.make_vocab_size_divisible_by=128",
         "moe.num_experts=4", "moe.top_k=2", "moe.ffn_hidden_size=32", "moe.aux_loss_coeff=0.1",
         "training.micro_batch_size=3", "training.global_batch_size=3", "training.device=cpu"]
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
# name: overrides of MODEL at the case's layout (2 processes)
CASES = {
    "dense-tp2-sp": ["moe.num_experts=0", *TP2_SP],
    "dense-tp2": ["moe.num_experts=0", "parallel.tensor_model_parallel_size=2"],
    "moe-tp2-sp-z-loss-dense-first-layer": [*TP2_SP, "moe.z_loss_coeff=0.01", "moe.first_dense_layers=1"],
    "moe-tp2-sp-sequence-aux-shared-gate-swiglu": [
        *TP2_SP, "moe.aux_loss_type=sequence", "moe.shared_expert_ffn_hidden_size=16", "moe.shared_expert_gate=true",
        "model.activation=swiglu"],
    "moe-tp2-sp-global-aux-rmsnorm": [*TP2_SP, "moe.aux_loss_type=global", "model.normalization=RMSNorm"],
    "moe-tp2-sp-expert-bias": [*TP2_SP, "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
                               "moe.router_bias_update_rate=0.01"],
    "moe-tp2-sp-ep2-folded": [*TP2_SP, "parallel.expert_model_parallel_size=2", "moe.z_loss_coeff=0.01"],
    "moe-tp2-sp-ep2-more-ranks-than-experts": [*TP2_SP, "parallel.expert_model_parallel_size=2",
                                              "moe.num_experts=1", "moe.top_k=1"],
    # query/key norms: per head (megatron-core's, Qwen3-MoE) and over the whole projection, its
    # weight split over the tensor ranks (OLMoE), with grouped-query attention
    "moe-tp2-sp-qk-norm-per-head-gqa": [*TP2_SP, "model.normalization=RMSNorm", "model.qk_layernorm=true",
                                        "model.num_query_groups=2", "model.kv_channels=12"],
    "moe-tp2-sp-qk-norm-projection-gqa": [*TP2_SP, "model.normalization=RMSNorm", "model.qk_layernorm=true",
                                          "model.qk_layernorm_scope=projection", "model.num_query_groups=2"],
    # each expert's FFN split over the two tensor ranks (expert tensor parallelism)
    "moe-tp2-sp-etp2-swiglu-z-loss": [*TP2_SP, "parallel.expert_tensor_parallel_size=2", "model.activation=swiglu",
                                      "moe.z_loss_coeff=0.01"],
}
if megatron_core_release() >= (0, 19):  # the projection-wide norm is refused there (config validation)
    del CASES["moe-tp2-sp-qk-norm-projection-gqa"]


def _config(overrides, world_size):
    cfg = resolve(load_config(None, MODEL + list(overrides)))
    validate(cfg, world_size=world_size)
    return cfg


def _batch(cfg):
    g = torch.Generator().manual_seed(7)
    s, b = cfg.model.seq_length, cfg.training.micro_batch_size
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(s).expand(b, s)


def _layout(cfg):
    par = cfg.parallel
    return (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size,
            par.expert_tensor_parallel_size)


def _model(cfg):
    env = init_distributed("cpu", *_layout(cfg))
    seed_everything(cfg.training.seed, env)
    return build_gpt_model(cfg, vocab_size=VOCAB, on_cuda=False).double()


def _loss(model, cfg):
    """Mean next-token loss in float64. megatron's vocabulary-parallel cross-entropy computes in fp32,
    so the logits (split over the vocabulary) are gathered and the loss taken here; training's own
    loss path is compared with one process in test_tensor_parallel_training."""
    tokens, labels, positions = _batch(cfg)
    set_aux_loss_scale(1.0, 1)
    logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))  # [b, s, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _expert_loads(model):
    """The loads each router's aux-loss-free bias update receives (summed over ranks), per data-
    parallel rank: what the update of this step's routing moves the biases by."""
    loads = []
    for module in model.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.apply_bias_update = lambda load: loads.append(load.clone())
    update_expert_biases(model)
    return [load / ps.get_data_parallel_world_size() for load in loads]


def _reference_grads(cfg_one):
    model = _model(cfg_one)
    _loss(model, cfg_one).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}, _expert_loads(model)


def _expert_layouts(model):
    return {f"{name}.{pname}": module.layout for name, module in model.named_modules()
            if isinstance(module, ExpertMLP) for pname, _ in module.named_parameters(recurse=False)}


def _expected(name, param, full, layouts):
    if is_expert_parallel(param):
        return layouts[name].local_slice(full)
    if getattr(param, "tensor_model_parallel", False):
        dim, tp = param.partition_dim, ps.get_tensor_model_parallel_world_size()
        return full.chunk(tp, dim=dim)[ps.get_tensor_model_parallel_rank()]
    return full


def check_case(name):
    overrides = CASES[name]
    cfg = _config(overrides, 2)
    one = _config([o for o in overrides if not o.startswith("parallel.")], 1)
    reference, loads = _reference_grads(one)

    model = _model(cfg)
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False),
    )
    ddp.zero_grad_buffer()
    _loss(ddp, cfg).backward()
    got_loads = _expert_loads(model)
    finalize_model_grads([ddp])
    layouts = _expert_layouts(model)
    checked = 0
    for pname, param in model.named_parameters():
        expected = _expected(pname, param, reference[pname], layouts)
        got = param.main_grad
        assert got.shape == expected.shape, (name, pname, got.shape, expected.shape)
        err = (got - expected).norm() / expected.norm().clamp(min=1e-30)
        assert err < 1e-10, (name, pname, err.item())
        checked += 1
    assert checked == len(reference), (name, checked, len(reference))
    # the aux-loss-free bias update counts the loads of every sequence shard (the reference ranks
    # of this world each ran the whole batch); read before finalize_model_grads, whose own update
    # (megatron-core's, over the same group) resets the counts
    assert len(got_loads) == len(loads) and all(torch.equal(a, b) for a, b in zip(got_loads, loads)), name
    assert bool(loads) == cfg.moe.router_enable_expert_bias, name
    # the clipping norm, on every rank (ranks that disagree on it would clip their replicas apart)
    for param in model.parameters():
        param.grad = param.main_grad
    expected_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in reference.values())).item()
    norm = global_grad_norm(model.parameters())
    assert abs(norm - expected_norm) <= 1e-10 * expected_norm, (name, norm, expected_norm)
    # the sequence-parallel marking is what makes this hold: the router and norms carry it under SP
    if cfg.parallel.sequence_parallel:
        marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        assert any("layernorm" in n for n in marked), marked
        if cfg.moe.num_experts:
            assert any("router" in n for n in marked), marked


def check_all_cases():
    for name in CASES:
        check_case(name)
