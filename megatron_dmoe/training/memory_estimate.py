"""Each rank's peak GPU memory estimated from the resolved configuration alone, before any model is
built: what `torch.cuda.max_memory_allocated` would report after a few training steps.

Pure arithmetic over the shapes the model really has (model/gpt.py, model/spec.py, moe/): no
tensor is allocated. The CUDA context, NCCL's buffers and the caching allocator's unused reserve
lie outside that figure; the refusal threshold (`training.memory_check`, a fraction of the GPU's
memory) leaves room for them.

Terms, in bytes, for the pipeline rank that needs the most:
- weights: every parameter on this rank, in the run's precision (bf16/fp16: 2 bytes, fp32: 4);
- grads: megatron's DDP keeps one fp32 main_grad per parameter (grad_reduce_in_fp32);
- optimizer: Adam's two fp32 moments, and with bf16/fp16 the fp32 master weights; the distributed
  optimizer shards them over the data-parallel ranks (expert parameters over the expert-data-
  parallel ranks);
- activations: what one micro-batch's forward keeps for backward (times the micro-batches a
  pipeline stage holds in flight), and the larger of what the loss keeps (the vocabulary logits,
  the output layer's gradients) and a layer's backward transient; the block-sparse experts'
  buffers are sized for the worst-case padding,
  T*k + E*(block-1) rows (docs/performance.md, "Activation memory");
- graphs: with captured layers (training.cuda_graphs), the layers' activations live in the graphs'
  private pool: that part is reported here instead of under activations;
- a fixed allowance (workspaces, the optimizer's small buffers, the allocator's rounding).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_dmoe.config import RunConfig, latent_attention
from megatron_dmoe.config.moe_layers import moe_layer_pattern
from megatron_dmoe.config.moe_settings import BLOCK_SIZES
from megatron_dmoe.parallel.layout_rules import ffn_shards_per_expert

GIB = 2**30
# training.memory_check: true refuses a GPU run whose estimate exceeds this share of the GPU's memory
DEFAULT_MEMORY_FRACTION = 0.9
# workspaces (cuBLAS, the fused kernels), the optimizer's and DDP's small buffers, allocator rounding
ALLOWANCE_BYTES = GIB // 4
# [T, hidden]-sized tensors a transformer layer keeps for backward besides its qkv output and its
# MLP's own: the layer input, the normed input, the attention output, the residual sum and the
# normed sum. Five, not the six one might count (the attention output's [s, b, h] copy too): that is
# what the measured peaks of the zoo's Small models say (docs/performance.md, "Memory estimate").
ATTENTION_HIDDEN_COPIES = 5


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the rank that needs the most (see the module docstring)."""
    weights: int
    grads: int
    optimizer: int
    activations: int
    graphs: int
    allowance: int
    parameters: int  # parameters held by that rank

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.graphs + self.allowance

    def line(self, device_bytes: Optional[int] = None, per: str = "GPU") -> str:
        """'memory: ~X GiB per GPU estimated (weights A, grads B, optimizer C, activations D,
        graphs E) of F GiB' (without 'of F GiB' when the device's memory is not known; `per`
        'process' for a CPU run)."""
        def g(n: int) -> str:
            return f"{n / GIB:.1f}"

        of = f" of {g(device_bytes)} GiB" if device_bytes else ""
        return (f"memory: ~{g(self.total)} GiB per {per} estimated (weights {g(self.weights)}, grads "
                f"{g(self.grads)}, optimizer {g(self.optimizer)}, activations {g(self.activations)}, graphs "
                f"{g(self.graphs)}){of}")


# --- parameters


def padded_vocab(vocab_size: int, cfg: RunConfig) -> int:
    """Megatron-LM's padding of the embedding rows (the same rule as model/gpt.padded_vocab_size)."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def _head_dim(cfg: RunConfig) -> int:
    return cfg.model.kv_channels or cfg.model.hidden_size // cfg.model.num_attention_heads


def _query_groups(cfg: RunConfig) -> int:
    return cfg.model.num_query_groups or cfg.model.num_attention_heads


def _glu(cfg: RunConfig) -> int:
    """2 for SwiGLU (two up-projections), else 1."""
    return 2 if cfg.model.activation == "swiglu" else 1


def _norm_params(cfg: RunConfig) -> int:
    return cfg.model.hidden_size * (2 if cfg.model.normalization == "LayerNorm" else 1)


def attention_params(cfg: RunConfig) -> int:
    """One layer's attention and its two norms on one tensor-parallel rank."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if m.multi_latent_attention:  # its projections (split over the tensor-parallel ranks, roughly)
        weights = sum(i * o for i, o in latent_attention.projection_shapes(m)) // tp
        return weights + (m.hidden_size if m.add_bias_linear else 0) + 2 * _norm_params(cfg) \
            + latent_attention.latent_norm_widths(m)
    h, d = m.hidden_size, _head_dim(cfg)
    qkv_out = (m.num_attention_heads + 2 * _query_groups(cfg)) * d // tp
    proj_in = m.num_attention_heads * d // tp
    bias = (qkv_out if m.add_bias_linear or m.add_qkv_bias else 0) + (h if m.add_bias_linear else 0)
    qk_norms = 0
    if m.qk_layernorm and m.qk_layernorm_scope == "projection":  # RMSNorms over this rank's heads
        qk_norms = (m.num_attention_heads + _query_groups(cfg)) * d // tp
    elif m.qk_layernorm:  # one norm over a head's width, for the queries and for the keys
        qk_norms = 2 * d * (2 if m.normalization == "LayerNorm" else 1)
    return qkv_out * h + h * proj_in + bias + 2 * _norm_params(cfg) + qk_norms


def dense_mlp_params(cfg: RunConfig) -> int:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    h, f = m.hidden_size, m.ffn_hidden_size // tp
    bias = _glu(cfg) * f + h if m.add_bias_linear else 0
    return _glu(cfg) * f * h + f * h + bias


def local_expert_params(cfg: RunConfig) -> int:
    """This rank's share of one MoE layer's expert weights (w1, w2, and v1 for SwiGLU; no biases)."""
    moe, par = cfg.moe, cfg.parallel
    ranks = par.expert_model_parallel_size * par.expert_tensor_parallel_size
    per_weight = moe.num_experts * moe.ffn_hidden_size * cfg.model.hidden_size // ranks
    return (_glu(cfg) + 1) * per_weight


def moe_other_params(cfg: RunConfig) -> int:
    """One MoE layer's replicated parameters: the router and the shared experts (with their gate)."""
    moe, h = cfg.moe, cfg.model.hidden_size
    shared = (_glu(cfg) + 1) * moe.shared_expert_ffn_hidden_size * h
    gate = h if moe.shared_expert_ffn_hidden_size and moe.shared_expert_gate else 0
    return moe.num_experts * h + shared + gate


def layer_pattern(cfg: RunConfig) -> List[bool]:
    """Which layers (0-based) are MoE layers: the rule the model is built with."""
    if not cfg.moe.num_experts:
        return [False] * cfg.model.num_layers
    return moe_layer_pattern(cfg.model.num_layers, cfg.moe.layer_freq, cfg.moe.first_dense_layers)


def rank_layers(cfg: RunConfig, pp_rank: int) -> List[List[bool]]:
    """The layers of pipeline rank `pp_rank`, one list per model chunk (virtual stage), each True
    where the layer is MoE: megatron-core's even split (get_transformer_layer_offset)."""
    pattern, par = layer_pattern(cfg), cfg.parallel
    pp, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per_chunk = len(pattern) // (pp * vp)
    chunks = []
    for stage in range(vp):
        offset = stage * (len(pattern) // vp) + pp_rank * per_chunk
        chunks.append(pattern[offset:offset + per_chunk])
    return chunks


def rank_parameters(cfg: RunConfig, vocab_size: int, pp_rank: int = 0) -> Tuple[int, int]:
    """(parameters, of which expert parameters) that pipeline rank `pp_rank` holds on one
    tensor/expert-parallel rank: what summing `p.numel()` over its built model chunks gives."""
    m, par = cfg.model, cfg.parallel
    pp, tp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    h, vocab = m.hidden_size, padded_vocab(vocab_size, cfg) // tp
    layers = [moe for chunk in rank_layers(cfg, pp_rank) for moe in chunk]
    experts = sum(local_expert_params(cfg) for moe in layers if moe)
    total = experts + len(layers) * attention_params(cfg)
    total += sum(moe_other_params(cfg) if moe else dense_mlp_params(cfg) for moe in layers)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        total += vocab * h
        if m.position_embedding_type == "learned_absolute":
            total += m.max_position_embeddings * h
    if last:
        total += _norm_params(cfg)  # the final norm
        if m.untie_embeddings_and_output_weights or not first:
            total += vocab * h  # the output layer (with tied embeddings: the last stage's copy)
    return total, experts


# --- activations


def _tokens(cfg: RunConfig) -> Tuple[int, int]:
    """(tokens of one micro-batch in this rank's norms and residuals, tokens in its MoE layers):
    sequence parallelism splits both over the tensor-parallel ranks."""
    tokens = cfg.training.micro_batch_size * cfg.model.seq_length
    if cfg.parallel.sequence_parallel:
        tokens //= cfg.parallel.tensor_model_parallel_size
    return tokens, tokens


def _elem(cfg: RunConfig) -> int:
    return 2 if cfg.training.bf16 or cfg.training.fp16 else 4


def expert_backend(cfg: RunConfig, on_cuda: bool) -> str:
    """The experts' backend a run gets: `auto` is the block-sparse `sparse` on CUDA, `reference`
    elsewhere (moe/experts/backends.py); a token-dropping MoE runs its own batched products."""
    if cfg.moe.expert_capacity_factor is not None:
        return "capacity"
    if cfg.moe.backend != "auto":
        return cfg.moe.backend
    return "sparse" if on_cuda else "reference"


def _local_experts_and_width(cfg: RunConfig) -> Tuple[int, int]:
    moe, par = cfg.moe, cfg.parallel
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    shards = ffn_shards_per_expert(moe.num_experts, ep, etp)
    return max(1, moe.num_experts // ep), moe.ffn_hidden_size // shards


def sparse_rows(cfg: RunConfig, tokens: int) -> int:
    """Rows of the block-sparse buffers: every routed copy plus the worst-case padding of each local
    expert's last block (T*k + E*(block-1), E the local experts)."""
    experts, width = _local_experts_and_width(cfg)
    block = next((b for b in sorted(BLOCK_SIZES, reverse=True)
                  if b <= cfg.moe.block_size and width % b == 0), min(BLOCK_SIZES))
    return tokens * cfg.moe.top_k + experts * (block - 1)


def moe_mlp_activations(cfg: RunConfig, on_cuda: bool, world_size: int = 1) -> Tuple[int, int]:
    """(bytes an MoE layer's MLP keeps for backward beyond its input, its backward's transient) for
    one micro-batch; world_size sets the micro-batches per data-parallel rank whose operands
    moe.expert_wgrad_per_step keeps until the step's end."""
    moe, e = cfg.moe, _elem(cfg)
    h = cfg.model.hidden_size
    _, tokens = _tokens(cfg)
    local_experts, width = _local_experts_and_width(cfg)
    glu = _glu(cfg)
    router = 2 * tokens * moe.num_experts * 4 + tokens * moe.top_k * 16  # fp32 logits, scores; weights, indices
    backend = expert_backend(cfg, on_cuda)
    if backend == "capacity":
        rows = -(-int(moe.expert_capacity_factor * tokens * moe.top_k) // moe.num_experts) * moe.num_experts
        extra = tokens * moe.top_k * h  # the gathered outputs the weighted sum keeps
    elif backend == "sparse":
        # the padded buffers of the rows the exchange delivers, sized by its receive buffer
        rows = sparse_rows(cfg, tokens * _receive_bound_ranks(cfg, on_cuda))
        extra = 0
    else:  # grouped, reference: the routed copies, gathered
        rows = tokens * moe.top_k
        extra = tokens * moe.top_k * h
    if cfg.parallel.expert_model_parallel_size * cfg.parallel.expert_tensor_parallel_size > 1:
        # the exchange's send buffer and its receive buffer
        extra += (1 + _receive_bound_ranks(cfg, on_cuda)) * tokens * moe.top_k * h
    # the experts' input rows, pre-activation(s) and activation (recomputed when memory-optimised,
    # and into its slot when the sparse experts' weight gradients go through windows, but with fp8
    # products: moe/experts/products.py)
    fp8 = backend == "sparse" and cfg.training.fp8 is not None
    recomputed = moe.memory_optimized or (backend == "sparse" and wgrad_window(cfg) > 1 and not fp8)
    hidden = glu + (0 if recomputed else 1)
    kept = (rows * h + rows * width * hidden + extra) * e + router
    kept += tokens * moe.shared_expert_ffn_hidden_size * (glu + 1) * e
    # backward: the output gradient in the padded rows twice, the activation's gradient, dx
    transient = (2 * rows * h + 2 * rows * width) * e
    if fp8:
        # the weights' e4m3 copies (one byte an element) a forward keeps for its backward, w1 [and
        # v1] row-major and w2 K-major; the backward quantizes them in the other layouts
        copies = local_experts * width * h * (glu + 1)
        kept += copies
        transient += copies
    if moe.expert_wgrad_per_step:
        # every micro-batch's weight-gradient operands until the step's end
        kept += (2 * rows * h + 2 * rows * width) * e * micro_batches_per_step(cfg, world_size)
    return kept, transient


def _receive_bound_ranks(cfg: RunConfig, on_cuda: bool) -> int:
    """How many ranks' tokens an expert-parallel receive buffer is sized for: the exchanges that keep
    the split sizes on the device (symmetric, nvshmem; auto on CUDA within a host) deliver into a
    buffer of the bound, ranks x T x k rows, whose real rows come first; NCCL's holds about T x k."""
    ranks = cfg.parallel.expert_model_parallel_size * cfg.parallel.expert_tensor_parallel_size
    if ranks == 1 or cfg.moe.ep_exchange == "nccl" or not on_cuda:
        return 1
    return ranks


def micro_batches_per_step(cfg: RunConfig, world_size: int = 1) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    par = cfg.parallel
    dp = max(1, world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size))
    return max(1, cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp))


def wgrad_window(cfg: RunConfig) -> int:
    """moe.expert_wgrad_window as a number. `auto` is decided at start-up from this estimate
    (training/wgrad_window_auto.py); until then it counts as 1, a window's least memory."""
    window = cfg.moe.expert_wgrad_window
    return window if isinstance(window, int) else 1


def wgrad_window_bytes(cfg: RunConfig, pp_rank: int, on_cuda: bool) -> int:
    """The slots of moe.expert_wgrad_window on pipeline rank `pp_rank`, held for the whole run: per
    MoE layer and expert weight, W copies of its gradient's operands at their bound (the sparse
    activation or its gradient, and the expert input rows or output gradient); the receive bound of
    expert parallelism's exchange is ranks x T x k rows."""
    moe = cfg.moe
    window = wgrad_window(cfg)
    if window <= 1 or moe.num_experts == 0 or expert_backend(cfg, on_cuda) != "sparse":
        return 0
    _, tokens = _tokens(cfg)
    _, width = _local_experts_and_width(cfg)
    rows = sparse_rows(cfg, tokens * _receive_bound_ranks(cfg, on_cuda))
    weights = 1 + _glu(cfg)  # w1 (and v1), w2
    layers = sum(moe_layer for chunk in rank_layers(cfg, pp_rank) for moe_layer in chunk)
    return layers * weights * window * rows * (width + cfg.model.hidden_size) * _elem(cfg)


def layer_activations(cfg: RunConfig, moe: bool, on_cuda: bool, world_size: int = 1) -> Tuple[int, int]:
    """(bytes one layer keeps for backward for one micro-batch, its backward's transient)."""
    m, e, tp = cfg.model, _elem(cfg), cfg.parallel.tensor_model_parallel_size
    h = m.hidden_size
    tokens, _ = _tokens(cfg)
    full = cfg.training.micro_batch_size * m.seq_length  # tokens the tensor-parallel parts see
    qkv = (m.num_attention_heads + 2 * _query_groups(cfg)) * _head_dim(cfg) // tp
    if m.multi_latent_attention:  # queries, keys and values at their heads' widths, and the latents
        qk, v = latent_attention.core_widths(m)
        qkv = (2 * qk + v) // tp + m.kv_lora_rank + (m.q_lora_rank or 0)
    norms = 2 * 2 * tokens * 4  # each norm's fp32 mean and inverse deviation
    attention = (ATTENTION_HIDDEN_COPIES * tokens * h + full * qkv) * e + norms
    if moe:
        mlp, transient = moe_mlp_activations(cfg, on_cuda, world_size)
    else:
        f = m.ffn_hidden_size // tp
        mlp = full * f * (_glu(cfg) + 1) * e  # the up-projection(s) and the activation
        transient = 2 * full * f * _glu(cfg) * e + full * h * e
    return attention + mlp, transient


def _in_flight(cfg: RunConfig, pp_rank: int, world_size: int) -> int:
    """Micro-batches (model-chunk micro-batches with the interleaved schedule) whose activations
    pipeline rank `pp_rank` holds at once under megatron's 1F1B schedules."""
    par = cfg.parallel
    pp, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    micro = micro_batches_per_step(cfg, world_size)
    if pp == 1:
        return 1
    if vp is None:
        return min(pp - pp_rank, micro)
    return min((pp - pp_rank - 1) * 2 + (vp - 1) * pp + 1, micro * vp)


def logits_bytes(cfg: RunConfig, vocab_size: int, on_cuda: bool) -> int:
    """What the language-model loss keeps: the [tokens, vocabulary] logits (our fused loss writes
    their gradient in place); megatron's unfused loss keeps an fp32 softmax besides them."""
    m, par = cfg.model, cfg.parallel
    tokens = cfg.training.micro_batch_size * m.seq_length
    vocab = padded_vocab(vocab_size, cfg) // par.tensor_model_parallel_size
    fused = (on_cuda and m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl in ("auto", "triton")
             and par.tensor_model_parallel_size == 1)
    return tokens * vocab * (_elem(cfg) + (0 if fused else 2 * 4))


def rank_activations(cfg: RunConfig, vocab_size: int, pp_rank: int, world_size: int,
                     on_cuda: bool) -> Tuple[int, int]:
    """(the transient at the peak, what the layers keep) of pipeline rank `pp_rank`, in bytes.

    The peak comes where backward starts, at the loss (the logits, the output layer's gradients),
    or inside one layer's backward (its transient, after the logits are freed): whichever is larger,
    on top of what every layer keeps for the micro-batches in flight."""
    m, e = cfg.model, _elem(cfg)
    h = m.hidden_size
    tokens, _ = _tokens(cfg)
    chunks = rank_layers(cfg, pp_rank)
    layers = [moe for chunk in chunks for moe in chunk]
    sizes = [layer_activations(cfg, moe, on_cuda, world_size) for moe in layers]
    flight = _in_flight(cfg, pp_rank, world_size)
    per_chunk = max(1, len(chunks))
    if cfg.training.recompute_granularity == "full":
        # each layer keeps its input; the layer recomputed in backward keeps all of its own for a moment
        kept = tokens * h * e * len(layers)
        transient = max((s[0] + s[1] for s in sizes), default=0)
    else:
        kept = sum(s[0] for s in sizes)
        if cfg.training.recompute_granularity == "selective":
            kept -= len(layers) * tokens * h * e  # the attention output, recomputed
        transient = max((s[1] for s in sizes), default=0)
    head = 0
    if pp_rank == cfg.parallel.pipeline_model_parallel_size - 1:
        # the logits, the final norm's output and input gradient, the output layer's weight gradient
        vocab = padded_vocab(vocab_size, cfg) // cfg.parallel.tensor_model_parallel_size
        head = logits_bytes(cfg, vocab_size, on_cuda) + 2 * tokens * h * e + vocab * h * e
    return max(head, transient), kept * flight // per_chunk


# --- the whole estimate


def _data_parallel(cfg: RunConfig, world_size: int) -> Tuple[int, int]:
    par = cfg.parallel
    dp = max(1, world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size))
    edp = max(1, world_size // (par.expert_model_parallel_size * par.expert_tensor_parallel_size
                                * par.pipeline_model_parallel_size))
    return dp, edp


def estimate_rank(cfg: RunConfig, vocab_size: int, world_size: int, pp_rank: int, on_cuda: bool = True,
                  graphs: Optional[bool] = None) -> MemoryEstimate:
    """The estimate of pipeline rank `pp_rank`. graphs: whether the layers are captured (None: as
    training.cuda_graphs says, on CUDA)."""
    if graphs is None:
        graphs = on_cuda and cfg.training.cuda_graphs is True
    params, experts = rank_parameters(cfg, vocab_size, pp_rank)
    e = _elem(cfg)
    half = e == 2
    dp, edp = _data_parallel(cfg, world_size)
    # Adam's two fp32 moments, and fp32 master weights for 16-bit parameters
    per_param = 8 + (4 if half else 0)
    if cfg.training.use_distributed_optimizer:
        optimizer = per_param * ((params - experts) // dp + experts // edp)
    else:
        optimizer = per_param * params
    peak, layers = rank_activations(cfg, vocab_size, pp_rank, world_size, on_cuda)
    return MemoryEstimate(
        weights=params * e,
        grads=params * 4 + wgrad_window_bytes(cfg, pp_rank, on_cuda),  # windows' slots: gradient operands
        optimizer=optimizer,
        activations=peak + (0 if graphs else layers),
        graphs=layers if graphs else 0,
        allowance=ALLOWANCE_BYTES if on_cuda else 0,
        parameters=params,
    )


def estimate_memory(cfg: RunConfig, vocab_size: int, world_size: int = 1, on_cuda: bool = True,
                    graphs: Optional[bool] = None) -> MemoryEstimate:
    """The estimate of the pipeline rank that needs the most (every rank holds as much or less).
    `cfg` resolved and valid; `vocab_size` the tokenizer's (before padding); `world_size` processes."""
    ranks = range(cfg.parallel.pipeline_model_parallel_size)
    return max((estimate_rank(cfg, vocab_size, world_size, r, on_cuda, graphs) for r in ranks),
               key=lambda est: est.total)


# --- refusing what cannot fit, with what would


def memory_limit(cfg: RunConfig, device_bytes: int) -> Optional[int]:
    """The most a run may be estimated to need under training.memory_check (None: not checked)."""
    check = cfg.training.memory_check
    if check is False:
        return None
    fraction = DEFAULT_MEMORY_FRACTION if check is True else float(check)
    return int(fraction * device_bytes)


def _changed(cfg: RunConfig, **changes) -> RunConfig:
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(out, section), key, value)
    return out


def what_would_fit(cfg: RunConfig, vocab_size: int, world_size: int, limit: int,
                   graphs: Optional[bool] = None, on_cuda: bool = True) -> List[str]:
    """Settings that bring the estimate under `limit`, each with its estimate: the largest smaller
    micro-batch, the experts' recompute, full recompute, the distributed optimizer, and (on GPUs) the
    fewest GPUs (with expert parallelism and the distributed optimizer) that would do."""
    tr, moe, par = cfg.training, cfg.moe, cfg.parallel
    dp, _ = _data_parallel(cfg, world_size)

    def fits(c: RunConfig, ranks: int = world_size) -> Optional[float]:
        total = estimate_memory(c, vocab_size, ranks, on_cuda, graphs).total
        return total / GIB if total <= limit else None

    found = []
    mbs = tr.micro_batch_size // 2
    while mbs >= 1:
        if tr.global_batch_size % (mbs * dp) == 0:
            gib = fits(_changed(cfg, training__micro_batch_size=mbs))
            if gib is not None:
                found.append(f"training.micro_batch_size={mbs} (~{gib:.1f} GiB)")
                break
        mbs //= 2
    if moe.num_experts and not moe.memory_optimized:
        gib = fits(_changed(cfg, moe__memory_optimized=True))
        if gib is not None:
            found.append(f"moe.memory_optimized=true (~{gib:.1f} GiB)")
    if tr.recompute_granularity != "full":
        gib = fits(_changed(cfg, training__recompute_granularity="full", training__cuda_graphs=False))
        if gib is not None:
            found.append(f"training.recompute_granularity=full (~{gib:.1f} GiB)")
    if dp > 1 and not tr.use_distributed_optimizer:
        gib = fits(_changed(cfg, training__use_distributed_optimizer=True))
        if gib is not None:
            found.append(f"training.use_distributed_optimizer=true (~{gib:.1f} GiB)")
    for factor in (2, 4, 8, 16, 32, 64) if on_cuda else ():  # a CPU's processes share its memory
        ranks = world_size * factor
        changes = {"training__use_distributed_optimizer": True}
        ep = par.expert_model_parallel_size * factor
        if moe.num_experts and moe.expert_capacity_factor is None and moe.num_experts % ep == 0:
            changes["parallel__expert_model_parallel_size"] = ep
        candidate = _changed(cfg, **changes)
        if tr.global_batch_size % (tr.micro_batch_size * dp * factor):
            continue
        gib = fits(candidate, ranks)
        if gib is not None:
            how = " with parallel.expert_model_parallel_size=" + str(ep) if ep != par.expert_model_parallel_size \
                and "parallel__expert_model_parallel_size" in changes else ""
            found.append(f"{ranks} GPUs{how} and training.use_distributed_optimizer=true (~{gib:.1f} GiB each)")
            break
    return found


class MemoryCheckError(RuntimeError):
    """A GPU run estimated not to fit; the message is one line saying what would."""


def refusal(cfg: RunConfig, estimate: MemoryEstimate, vocab_size: int, world_size: int, device_bytes: int,
            graphs: Optional[bool] = None) -> Optional[str]:
    """The one line refusing a run whose estimate exceeds training.memory_check's share of
    `device_bytes`, naming what would fit; None when it fits or is not checked."""
    limit = memory_limit(cfg, device_bytes)
    if limit is None or estimate.total <= limit:
        return None
    share = limit / device_bytes
    options = what_would_fit(cfg, vocab_size, world_size, limit, graphs)
    fix = ("; these would fit: " + ", ".join(options)) if options else \
        "; no single change of micro-batch, recompute or GPU count found that fits"
    return (f"{estimate.line(device_bytes)[len('memory: '):]}, more than training.memory_check allows "
            f"({share:.0%} of the GPU, {limit / GIB:.1f} GiB){fix} (training.memory_check=false runs it anyway)")


def known_vocab_size(cfg: RunConfig) -> Optional[int]:
    """The model's vocabulary where the configuration alone tells it (model.vocab_size, the
    built-in corpus's tokenizer, NullTokenizer's ids and end-of-document id); None where the
    tokenizer has to be read."""
    data = cfg.data
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if data.tokenizer_type == "NullTokenizer" and data.vocab_size:
        return data.vocab_size + 1
    if not data.data_path and not data.tokenizer_type and not data.tokenizer_model:
        return data.builtin_vocab_size
    return None


def check_memory(cfg: RunConfig, vocab_size: int, world_size: int, device_bytes: int) -> str:
    """A GPU run's start-up line ('memory: ~X GiB per GPU estimated (...) of F GiB'); raises
    MemoryCheckError, one line saying what would fit, where training.memory_check refuses it."""
    estimate = estimate_memory(cfg, vocab_size, world_size, on_cuda=True)
    problem = refusal(cfg, estimate, vocab_size, world_size, device_bytes)
    if problem:
        raise MemoryCheckError(problem)
    return estimate.line(device_bytes)


def check_host_memory(cfg: RunConfig, vocab_size: int, world_size: int, local_processes: int,
                      available_bytes: int) -> None:
    """A CPU run: raises MemoryCheckError, one line saying what would fit, where the estimate of the
    `local_processes` processes on this machine exceeds training.memory_check's share of
    `available_bytes` (the memory they can still take, training/host_memory.py)."""
    limit = memory_limit(cfg, available_bytes)
    estimate = estimate_memory(cfg, vocab_size, world_size, on_cuda=False)
    if limit is None or estimate.total * local_processes <= limit:
        return
    options = what_would_fit(cfg, vocab_size, world_size, limit // local_processes, on_cuda=False)
    fix = ("; these would fit: " + ", ".join(options)) if options else \
        "; make the model smaller (model.hidden_size, model.num_layers, moe.num_experts)"
    times = f" x {local_processes} processes" if local_processes > 1 else ""
    raise MemoryCheckError(
        f"{estimate.line(per='process')[len('memory: '):]}{times}, more than training.memory_check allows "
        f"({limit / available_bytes:.0%} of the {available_bytes / GIB:.1f} GiB this machine has available, "
        f"{limit / GIB:.1f} GiB){fix} (training.memory_check=false runs it anyway)")
