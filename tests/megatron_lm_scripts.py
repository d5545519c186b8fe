"""Megatron-LM's MoE launch scripts as their flags, sizes scaled down for a CPU and the data flags
left out (the built-in corpus trains instead): examples/mixtral/train_mixtral_8x7b_distributed.sh's
arrays, and the MoE guide's (megatron/core/transformer/moe/README.md) quick-start arguments on a
DeepSeek-style router. Everything else is as the scripts write it."""

MIXTRAL_MODEL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "64", "--max-position-embeddings", "256",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
    "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
]
MIXTRAL_MOE = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
]
MIXTRAL_TRAINING = [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "3",
    "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
]


def mixtral_parallel(ep: int):
    return ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--expert-model-parallel-size", str(ep), "--use-distributed-optimizer", "--sequence-parallel"]


def mixtral_logging(checkpoint_path):
    """LOGGING_ARGS; the script adds the W&B flags when WANDB_API_KEY is set (left out here)."""
    return ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
            "--save", str(checkpoint_path), "--load", str(checkpoint_path),
            "--tensorboard-dir", f"{checkpoint_path}/tensorboard", "--no-load-optim", "--no-load-rng"]


def mixtral(checkpoint_path, ep: int = 1):
    return [*MIXTRAL_MODEL, *MIXTRAL_MOE, *MIXTRAL_TRAINING, *mixtral_parallel(ep), *mixtral_logging(checkpoint_path)]


# the MoE guide's MOE_ARGS with DeepSeek-V3's router flags
MOE_GUIDE = [
    "--num-experts", "8", "--expert-model-parallel-size", "1", "--moe-grouped-gemm", "--moe-permute-fusion",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-3",
    "--use-distributed-optimizer", "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-3", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "64",
    "--moe-shared-expert-overlap", "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-ffn-hidden-size", "64",
    "--moe-per-layer-logging",
]
