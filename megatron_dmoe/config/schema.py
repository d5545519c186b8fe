"""The run configuration: one dataclass per YAML section, field names as in Megatron-LM.

Inside a section Megatron-LM's argument names are used without the section's prefix
(`moe.num_experts` is Megatron-LM's `--num-experts`, `moe.aux_loss_coeff` its `--moe-aux-loss-coeff`).
Defaults describe a small model that trains on a laptop CPU. Validation lives in `validate.py` (its
checks in `section_checks/`); loading, `extends:` and `key.sub=value` overrides in `load.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # grouped-query attention; None = multi-head
    kv_channels: Optional[int] = None  # the attention heads' width; None = hidden_size / num_attention_heads
    ffn_hidden_size: Optional[int] = None  # dense MLP width; None = 4 * hidden_size
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # None = seq_length
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary size
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # the share of each head's dimensions RoPE rotates (the rest pass unrotated)
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5  # the epsilon of every LayerNorm / RMSNorm
    # an RMSNorm (LayerNorm) of the queries and of the keys before RoPE: per head (Qwen3-MoE) or over
    # all heads of the projection at once (OLMoE)
    qk_layernorm: bool = False
    qk_layernorm_scope: str = "head"  # head | projection
    activation: str = "gelu"  # gelu | swiglu, for dense MLPs and experts alike
    # biases in the linear layers (experts never have any); Megatron-LM's --disable-bias-linear sets false
    add_bias_linear: bool = True
    # biases in the query, key and value projections (Qwen2's), whatever add_bias_linear says
    add_qkv_bias: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    transformer_impl: str = "auto"  # auto | local | transformer_engine
    cross_entropy_loss_fusion: bool = False  # a fused vocabulary cross-entropy (CUDA)
    cross_entropy_fusion_impl: str = "auto"  # auto | triton | native: ours (tensor-parallel 1) or megatron's
    # initialise every weight whole on the CPU, then split it: the same initial model at any tensor-
    # or pipeline-parallel layout (CPU runs always do); on GPUs each rank otherwise draws its own shard
    use_cpu_initialization: bool = False
    # Multi-latent attention (DeepSeek-V2/V3; megatron-core's MLA, built from local modules): queries
    # and keys/values through low-rank latents, each head's query/key a part without positions
    # (qk_head_dim) and a rotated part (qk_pos_emb_head_dim, its key shared by all heads);
    # model.kv_channels and num_query_groups do not apply. model.qk_layernorm adds RMSNorms of the
    # latents (DeepSeek's q_a_layernorm / kv_a_layernorm).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # the queries' latent width; None = one projection, no latent
    kv_lora_rank: int = 32  # the keys' and values' latent width
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE of multi-latent attention: rope, or yarn (YaRN scaling of the frequencies by
    # rotary_scaling_factor, its attention factor from mscale / mscale_all_dim, as DeepSeek
    # uses it); None = yarn with multi-latent attention (Megatron-LM's default), else rope
    rope_type: Optional[str] = None  # None | rope | yarn
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096  # YaRN: the context length trained before scaling
    beta_fast: float = 32.0  # YaRN's frequency ramp bounds (rotations)
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0 = dense model (no MoE layers)
    top_k: int = 1
    layer_freq: int = 1  # MoE MLP in every layer_freq-th layer (1 = every layer)
    first_dense_layers: int = 0  # the first N of those keep the dense MLP (DeepSeek's first_k_dense_replace)
    ffn_hidden_size: Optional[int] = None  # expert width; None = model.ffn_hidden_size
    router_score_function: str = "softmax"  # softmax | sigmoid
    router_pre_softmax: bool = True  # softmax over all experts before top-k (needed for top_k=1)
    router_renormalize: Optional[bool] = None  # top-k weights to sum 1; None = per score function
    router_topk_scaling_factor: float = 1.0
    input_jitter_eps: Optional[float] = None  # multiplicative input noise in training
    aux_loss_coeff: float = 0.01  # load-balancing loss; 0 disables it
    z_loss_coeff: float = 0.0  # router z-loss; 0 disables it
    router_enable_expert_bias: bool = False  # aux-loss-free balancing through a selection bias
    router_bias_update_rate: float = 1e-3
    expert_capacity_factor: Optional[float] = None  # None = dropless; a number = token dropping
    token_drop_policy: str = "probs"  # probs | position, with expert_capacity_factor
    backend: str = "auto"  # auto | sparse | grouped | reference
    block_size: int = 128  # block size of the sparse backend: 16 | 32 | 64 | 128 (config/moe_settings.py)
    memory_optimized: bool = False  # recompute the activation in backward
    # Expert weight gradients once per step over all micro-batches, not once per micro-batch (sparse
    # backend): main_grad read and written once; keeps every micro-batch's expert operands until then.
    expert_wgrad_per_step: bool = False
    # Expert weight gradients once per window of this many micro-batches (sparse backend; 1: once per
    # micro-batch): main_grad read and written once per window; each micro-batch's operands wait in
    # slots on the device until then (the activation's backward stores the wide ones there). Captured
    # layers hold it (the step's micro-batches must divide into whole windows). auto: the largest of
    # 8, 4 and 2 that divides the step's micro-batches and fits the GPU's memory, else 1, decided at
    # start-up (training/wgrad_window_auto.py).
    expert_wgrad_window: Union[int, str] = "auto"
    ep_exchange: str = "auto"  # auto | nccl | symmetric | nvshmem: how tokens travel between expert-parallel ranks
    # Shared experts (DeepSeek-MoE, Qwen-MoE): an MLP of this width that every token runs besides its
    # routed experts, added to their output; 0 = none. n shared experts of width f: n * f.
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False  # the shared MLP's output times a per-token sigmoid gate (Qwen-MoE)
    # What the load-balancing loss counts the experts' shares of tokens over: one micro-batch, each
    # sequence on its own (averaged), or every micro-batch of the step on every data-parallel rank
    # (megatron-core's aux_loss, seq_aux_loss, global_aux_loss)
    aux_loss_type: str = "micro_batch"  # micro_batch | sequence | global
    # Group-limited routing (DeepSeek-V2/V3): experts in router_num_groups equal groups; each token
    # keeps its router_group_topk best groups (scored by the sum of their best top_k / group_topk
    # scores), then picks top_k experts inside them. null = off (both null).
    router_num_groups: Optional[int] = None
    router_group_topk: Optional[int] = None
    # a group's score: the sum of its best top_k / group_topk scores (megatron-core, DeepSeek-V3)
    # or its best score (DeepSeek-V2)
    router_group_score: str = "sum"  # sum | max
    # The router's softmax and top-k (and the load-balancing loss's sums): auto = one fused Triton
    # kernel forward and one backward for fp32 CUDA logits where the settings allow (softmax,
    # router_pre_softmax, no groups, no expert bias, <= 256 experts), else torch's ops; fused = always
    # (an error where it cannot); torch = always torch's.
    router_impl: str = "auto"  # auto | fused | torch
    # The precision of the router's logits, scores, top-k choice and weights (megatron-core's
    # moe_router_dtype): fp64 for many experts; the experts' combine and the aux losses stay fp32.
    router_dtype: str = "fp32"  # fp32 | fp64
    # Random router logits with a straight-through gradient (megatron-core's
    # moe_router_force_load_balancing): experts evenly loaded whatever the model has learnt. For
    # speed measurements only: the model does not learn to route.
    router_force_load_balancing: bool = False
    # With checkpoint.upcycle_from: each dense MLP becomes this many experts of width ffn / N
    # (moe.ffn_hidden_size must be model.ffn_hidden_size / N)
    upcycle_granularity: int = 1


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # model chunks per pipeline rank (the interleaved schedule); None = one chunk
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    # Ranks each expert's FFN is split over (megatron-core's name); the experts' tokens travel over
    # expert_model_parallel_size x this many ranks, to every shard of their expert.
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    # Context parallelism is not supported; the key exists so that a Megatron-LM layout is refused
    # clearly instead of being ignored.
    context_parallel_size: int = 1
    # Data-parallel gradient reduction in buckets during backward, as each bucket's gradients are
    # complete (megatron-core's DDP overlap_grad_reduce), and with the distributed optimizer the
    # parameters' all-gather during the next forward (overlap_param_gather). auto = on for CUDA runs
    # over several hosts whose gradients cross ranks where it is correct, else off
    # (config/overlap_rules.py; a GPU run says why), decided at each start (config.yaml keeps auto).
    overlap_grad_reduce: Union[bool, str] = "auto"  # auto | true | false
    overlap_param_gather: Union[bool, str] = "auto"  # auto | true | false
    # elements per bucket when overlapping; None = megatron-core's max(40M, 1M x data-parallel size)
    ddp_bucket_size: Optional[int] = None


@dataclass
class TrainingConfig:
    train_iters: int = 200
    micro_batch_size: int = 8
    global_batch_size: int = 8
    seed: int = 1234
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 10
    lr_decay_style: str = "cosine"  # cosine | linear | constant | WSD
    lr_decay_iters: Optional[int] = None  # None = train_iters
    # WSD (warmup, stable, decay): lr stays at training.lr until the last lr_wsd_decay_iters of
    # lr_decay_iters, then falls to min_lr in this style (Megatron-LM's --lr-wsd-decay-*)
    lr_wsd_decay_style: str = "exponential"  # exponential | linear | cosine | minus_sqrt
    lr_wsd_decay_iters: Optional[int] = None  # needed with lr_decay_style: WSD
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # fp16 only; None = dynamic loss scaling
    initial_loss_scale: float = 2.0**16
    eval_interval: int = 50  # 0 disables evaluation during training
    eval_iters: int = 5
    # Stop (evaluating and saving a checkpoint) once this many minutes of training steps are spent,
    # summed over resumed pieces; startup, evaluation and checkpoint saving do not count. None = no limit.
    time_limit_minutes: Optional[float] = None
    recompute_granularity: Optional[str] = None  # None | full | selective
    use_distributed_optimizer: bool = False
    # Capture each transformer layer's forward and backward as CUDA graphs after the first step
    # (megatron-core's local implementation): removes the host's launch overhead. auto = on for
    # CUDA runs where capture is correct, else off with a note saying why (resolved at start-up;
    # the run's config.yaml holds the result); true = on, refused where capture is not correct.
    cuda_graphs: Union[bool, str] = "auto"  # auto | true | false
    # A GPU run whose estimated peak memory (training/memory_estimate.py, printed at start-up) exceeds
    # this share of its GPU's memory is refused before the model is built: true = 0.9, a number in
    # (0, 1] = that share, false = never refused. A CPU run: its processes on the machine together,
    # against this share of the memory the machine has available.
    memory_check: Union[bool, float] = True
    device: str = "auto"  # auto | cpu | cuda
    # Block-scaled fp8 (e4m3) products, DeepSeek-V3's recipe (dmoe_kernels.fp8): 1 x 128 scales on
    # activations and gradients, 128 x 128 on weights, fp32 accumulation; Hopper GPUs or newer.
    # Megatron-LM's --fp8-format e4m3 --fp8-recipe blockwise. The experts' products and the dense
    # linears' forward and input gradient run in fp8 (moe/experts/products.py, model/linear.py);
    # where it cannot run: config/section_checks/fp8.py.
    fp8: Optional[str] = None  # None | blockwise


@dataclass
class DataConfig:
    # Megatron-LM style: [prefix] or [weight, prefix, weight, prefix, ...]; empty = built-in corpus
    data_path: List[str] = field(default_factory=list)
    split: str = "969,30,1"
    # Megatron-LM's --valid-data-path: validation data of its own (same format as data_path); when
    # set, all of data_path is training data and split is not used.
    valid_data_path: List[str] = field(default_factory=list)
    # Megatron-LM's --tokenizer-type: GPT2BPETokenizer | HuggingFaceTokenizer | SentencePieceTokenizer |
    # GPTSentencePieceTokenizer | Llama2Tokenizer | TikTokenizer | NullTokenizer; None = a sentencepiece
    # data.tokenizer_model, or the built-in corpus's tokenizer (see data/megatron_tokenizers.py)
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None  # --tokenizer-model: sentencepiece/tiktoken file, HuggingFace folder
    vocab_file: Optional[str] = None  # --vocab-file: GPT2BPETokenizer's vocab.json
    merge_file: Optional[str] = None  # --merge-file: GPT2BPETokenizer's merges.txt
    vocab_size: Optional[int] = None  # --vocab-size: NullTokenizer's ids 0..vocab_size-1 (the eod is vocab_size)
    builtin_vocab_size: int = 4096  # vocabulary of the built-in corpus's tokenizer
    cache_dir: Optional[str] = None  # built-in corpus cache; None = ~/.cache/megatron_dmoe
    num_workers: int = 1  # the training loader's worker processes (evaluation reads in the training process)


@dataclass
class CheckpointConfig:
    save_interval: Optional[int] = None  # None = save only at the end; 0 = never save (benchmarks)
    keep_last: int = 2  # how many checkpoints to keep; 0 keeps all
    # Start from this checkpoint (a run directory, its checkpoints/ folder or one iter_N checkpoint),
    # as Megatron-LM's --load: the weights, and unless switched off below the optimizer state with
    # the learning-rate schedule, the RNG states and the step with the data position.
    load: Optional[str] = None
    load_optim: bool = True  # false: a fresh optimizer (Megatron-LM's --no-load-optim)
    load_rng: bool = True  # false: the RNG states from training.seed (--no-load-rng)
    finetune: bool = False  # true: the weights only, from step 0 (--finetune)
    # Start this MoE run from a dense run (its run directory, checkpoints/ folder or one iter_N
    # checkpoint): every expert a copy of the dense MLP (see moe.upcycle_granularity), the router
    # initialised as usual, all other weights copied. Not used when resuming this run.
    upcycle_from: Optional[str] = None


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True
    tensorboard_dir: Optional[str] = None  # where the TensorBoard events go; None = RUN_DIR/tensorboard
    # Weights & Biases: the run's scalars, as in TensorBoard, into this project (needs the wandb
    # package: pip install -e ".[wandb]"); None = no W&B logging
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None  # the W&B run's name; None = the run directory's name
    wandb_save_dir: Optional[str] = None  # W&B's local files; None = RUN_DIR/wandb
    wandb_mode: Optional[str] = None  # None | online | offline: None = wandb's own (WANDB_MODE, else online)
    progress_bar: str = "auto"  # auto | on | off
    plot: bool = True  # draw loss and expert-load plots into the run directory at the end
    peak_tflops: Optional[float] = None  # per-GPU peak for MFU (e.g. a measured bf16 matmul rate)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # the dotted keys whose values resolve() derived from other keys (DERIVED_FROM there) instead of
    # the user setting them: a run's config.yaml lists them, and resolving derives them again
    derived: Tuple[str, ...] = field(default=(), compare=False, repr=False)

SECTIONS = ("model", "moe", "parallel", "training", "data", "checkpoint", "logging")
