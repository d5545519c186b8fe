"""Settings and helpers of the tiny runs the after-training tests use (imported by conftest.py and tests)."""
COMMON = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "model.init_method_std=0.05",  # varied greedy continuations after two steps
    "training.micro_batch_size=4",
    "training.global_batch_size=8",
    "training.train_iters=2",
    "training.lr_warmup_iters=1",
    "training.eval_interval=2",
    "training.eval_iters=2",
    "logging.log_interval=1",
    "logging.progress_bar=off",
    "logging.tensorboard=false",
    "logging.plot=false",
]
# seed 3: initial weights whose greedy continuation of the tests' prompt varies, at megatron-core 0.16
# (Python 3.11) and 0.19 (Python 3.12) alike (each initialises and tokenizes its corpus a little differently)
DENSE = ["moe.num_experts=0", "training.seed=3"]
MIXTRAL = [
    "model.activation=swiglu",
    "model.normalization=RMSNorm",
    "model.position_embedding_type=rope",
    "model.rotary_base=500",
    "model.add_bias_linear=false",
    "model.untie_embeddings_and_output_weights=true",
    "model.num_query_groups=2",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.ffn_hidden_size=64",
    "moe.router_renormalize=true",
]


def make_untrained_run(run_dir, overrides, perturb=False):
    """A run directory as dmoe-train leaves it (config.yaml, a checkpoint at step 2), written in this
    process from the model's initial weights: no training, no subprocess. perturb: norms, biases and
    the expert bias drawn away from their initial ones and zeros, so that each is seen to be used."""
    from megatron_dmoe.config import load_config, resolve, save_config
    from megatron_dmoe.data import build_tokenizer
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything
    from megatron_dmoe.training.checkpoint import Progress, save_checkpoint
    from megatron_dmoe.training.run_dir import checkpoint_root

    cfg = resolve(load_config(None, overrides))
    save_config(cfg, run_dir / "config.yaml", versions={})
    env = init_distributed("cpu")
    try:
        seed_everything(cfg.training.seed, env)
        model = build_gpt_model(cfg, vocab_size=build_tokenizer(cfg).vocab_size, on_cuda=False)
        if perturb:
            _perturb(model)
        save_checkpoint(checkpoint_root(run_dir), [model], None, None, Progress(iteration=2), keep_last=2)
    finally:
        destroy_distributed()


def _perturb(model):
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "layernorm" in name and name.endswith("weight"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif name.endswith(("bias", "expert_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
