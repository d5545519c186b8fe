"""What a run builds and reports before its first step, in the order that matters to users:
everything that can fail because of their input (config, data files, tokenizer) fails before a
model is built or a checkpoint is touched, and nothing in the run directory changes until the
data, the model and (on resume) the checkpoint are loaded.

`set_up_run` does it all and returns a `Run`: the resolved config, the datasets, the model chunks
wrapped for training (16-bit wrapper where asked, then megatron-core's DDP), optimizer, scheduler
and the progress loaded from a checkpoint; it prints the run's first lines (device, data, model)
on rank 0 and writes the resolved config into the run directory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_dmoe.config import RunConfig
from megatron_dmoe.config.overlap_rules import resolve_overlap, with_overlap_as_asked
from megatron_dmoe.data import build_datasets, build_loader, build_tokenizer
from megatron_dmoe.data.cache_sharing import index_cache_writer
from megatron_dmoe.data.datasets import sequences_per_pass
from megatron_dmoe.model.cuda_graphs_auto import resolve_cuda_graphs
from megatron_dmoe.model.gpt import build_model_chunks
from megatron_dmoe.model.layer_seed import set_layer_init_seed
from megatron_dmoe.moe import MoERunState
from megatron_dmoe.parallel.distributed import DistEnv, barrier, seed_everything
from megatron_dmoe.parallel.param_roles import is_expert_parallel, is_tensor_parallel, set_main_grad_only
from megatron_dmoe.training.checkpoint import Progress, checkpoint_dir, latest_iteration, load_checkpoint
from megatron_dmoe.training.host_memory import available_host_bytes
from megatron_dmoe.training.load_source import load_start
from megatron_dmoe.training.memory_estimate import (
    MemoryCheckError,
    check_host_memory,
    check_memory,
    known_vocab_size,
)
from megatron_dmoe.training.metrics_log import METRICS_FILE
from megatron_dmoe.training.optim import build_optimizer, build_scheduler
from megatron_dmoe.training.run_dir import (
    checkpoint_root,
    previous_run_files,
    software_versions,
    write_run_config,
)
from megatron_dmoe.training.wgrad_window_auto import resolve_wgrad_window


@dataclass
class Run:
    """A run ready for its first step: what `set_up_run` built."""
    cfg: RunConfig  # training.cuda_graphs resolved to true or false
    env: DistEnv
    run_dir: Path
    ckpt_root: Path
    data: RunData
    run_state: MoERunState  # what the model's MoE layers share: metrics, deferred weight grads, exchanges
    model: List[DistributedDataParallel]  # one chunk per virtual pipeline stage
    optimizer: Any
    scheduler: Any
    progress: Progress  # where the run stands: step 0, or the loaded checkpoint's
    started_from: Optional[Path] = None  # checkpoint.load's checkpoint (--load), when the run started from one
    # training.cuda_graphs: auto resolved to capture: graphs whose memory pool would not fit are not kept
    graphs_must_fit: bool = False


def set_up_run(cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool, overwrite: bool = False,
               notices: Sequence[str] = ()) -> Run:
    """Resolve, load the data, build model, optimizer and scheduler, load the checkpoint, then
    write the run config; `cfg` is resolved and validated, process groups are initialised.

    Nothing in `run_dir` changes until the data, the model and (on resume) the checkpoint are
    loaded: then `overwrite` deletes a previous run's files and the resolved config is written.
    """
    run_dir = Path(run_dir)
    # training.cuda_graphs: auto becomes true or false here, once; config.yaml records which
    graphs_auto = cfg.training.cuda_graphs == "auto"
    cfg, graph_notes = resolve_cuda_graphs(cfg, env.on_cuda, env.world_size, env.local_world_size)
    # parallel.overlap_* are decided below, after the window; config.yaml keeps what was asked, so
    # that a resumed run decides again for its own layout and devices
    asked = cfg
    notices = [*notices, *graph_notes]
    tr = cfg.training

    def say(text: str) -> None:
        if env.is_main:
            print(text, flush=True)

    for notice in notices:
        say(notice)
    say(f"run directory: {run_dir}")
    ckpt_root = checkpoint_root(run_dir)
    latest = latest_iteration(ckpt_root) if resume else None  # a new run ignores old checkpoints
    if resume and latest is None:
        afresh = f" ({METRICS_FILE} starts afresh)" if METRICS_FILE in previous_run_files(run_dir) else ""
        say(f"no checkpoint in {ckpt_root}: starting a new run at step 0{afresh}")
    say(f"device: {describe_device(cfg, env)}")
    # the estimated peak memory (printed on GPUs), refused when it cannot fit (MemoryCheckError);
    # before the data where the config tells the vocabulary, else once the tokenizer is read;
    # moe.expert_wgrad_window: auto becomes a number with the same estimate (config.yaml records it)
    vocab = known_vocab_size(cfg)
    memory = None
    if vocab is not None:
        cfg = resolve_window(cfg, env, vocab, say)
        memory = memory_line(cfg, env, vocab)
    data = prepare_run_data(cfg, env)  # raises DataError before anything is built
    say(f"data: {describe_data(cfg, data)}")
    if vocab is None:
        cfg = resolve_window(cfg, env, data.vocab_size, say)
        memory = memory_line(cfg, env, data.vocab_size)
    if memory:
        say(memory)
    # parallel.overlap_*: auto becomes true or false once the graphs and the window are decided
    cfg, overlap_notes = resolve_overlap(cfg, env.on_cuda, env.world_size, env.local_world_size)
    for note in overlap_notes:
        say(note)

    seed_everything(tr.seed, env, cuda_graphs=tr.cuda_graphs)
    run_state = MoERunState()
    run_state.wgrad.use_window(cfg.moe.expert_wgrad_window)
    # each layer's weights from its number: the same at any pipeline layout; only while this run's
    # model is built (a later model in the same process is not seeded by this run)
    set_layer_init_seed(tr.seed)
    try:
        # one chunk per virtual pipeline stage (one without the interleaved schedule)
        model = build_model_chunks(cfg, vocab_size=data.vocab_size, on_cuda=env.on_cuda, run_state=run_state)
    finally:
        set_layer_init_seed(None)
    say(f"model: {describe_model(model, cfg, env.device)}")
    par = cfg.parallel
    model = wrap_for_training(model, tr.use_distributed_optimizer, overlap_grad_reduce=par.overlap_grad_reduce,
                              overlap_param_gather=par.overlap_param_gather, bucket_size=par.ddp_bucket_size)
    optimizer = build_optimizer(cfg, model, env.on_cuda)
    scheduler = build_scheduler(cfg, optimizer)

    progress = Progress(world_size=env.world_size)
    started_from = None  # checkpoint.load's checkpoint, when this run started from one
    ck = cfg.checkpoint
    if resume and latest is not None:
        # checkpoint.load_optim / load_rng (--no-load-optim, --no-load-rng) hold on a resume too;
        # the schedule follows the step either way
        progress = load_checkpoint(checkpoint_dir(ckpt_root, latest), model,
                                   optimizer if ck.load_optim else None, scheduler, rng=ck.load_rng)
        progress.world_size = env.world_size
    elif ck.load:
        progress, started_from = load_start(cfg, model, optimizer, scheduler, env.world_size)
    elif cfg.checkpoint.upcycle_from:
        from megatron_dmoe.training.upcycle import upcycle_dense_checkpoint

        upcycle_dense_checkpoint(cfg, model, optimizer)
    barrier()  # every rank has loaded before the run directory changes
    if env.is_main:
        write_run_config(with_overlap_as_asked(cfg, asked), run_dir, overwrite, software_versions())
    barrier()
    return Run(cfg=cfg, env=env, run_dir=run_dir, ckpt_root=ckpt_root, data=data, run_state=run_state,
               model=model, optimizer=optimizer, scheduler=scheduler, progress=progress,
               started_from=started_from, graphs_must_fit=graphs_auto and cfg.training.cuda_graphs is True)


def resolve_window(cfg: RunConfig, env: DistEnv, vocab_size: int, say) -> RunConfig:
    """cfg with moe.expert_wgrad_window: auto decided for this GPU's memory (its note said)."""
    device_bytes = torch.cuda.get_device_properties(env.device).total_memory if env.on_cuda else 0
    cfg, notes = resolve_wgrad_window(cfg, env.on_cuda, env.world_size, vocab_size, device_bytes)
    for note in notes:
        say(note)
    return cfg


def memory_line(cfg: RunConfig, env: DistEnv, vocab_size: int) -> Optional[str]:
    """The start-up summary's memory line on GPUs; on a CPU no line, but a run whose processes on
    this machine would need more than its available memory is refused too (MemoryCheckError)."""
    try:
        if not env.on_cuda:
            check_host_memory(cfg, vocab_size, env.world_size, env.local_world_size, available_host_bytes())
            return None
        total = torch.cuda.get_device_properties(env.device).total_memory
        return check_memory(cfg, vocab_size, env.world_size, total)
    except MemoryCheckError:
        if env.is_main:
            raise
        raise MemoryCheckError("") from None  # every rank refuses alike: rank 0 tells why


# --- data: tokenizer and datasets, checked before any model is built


@dataclass
class RunData:
    tokenizer: Any
    vocab_size: int  # of the model, before padding
    train: Any
    valid: Any


def prepare_run_data(cfg: RunConfig, env: DistEnv) -> RunData:
    """Build the tokenizer and the train/valid datasets; raises DataError on bad input.

    Rank 0 goes first so the built-in corpus and megatron's index caches are made once; the other
    ranks then find them ready.
    """
    writer = index_cache_writer(cfg)  # before rank 0 goes first: every rank takes part
    if not env.is_main:
        barrier()
    tokenizer = build_tokenizer(cfg)
    tr = cfg.training
    # Every evaluation reads the same first eval_iters batches, so validation curves compare
    # like with like and a resumed run evaluates exactly as an uninterrupted one.
    valid_samples = tr.eval_iters * tr.global_batch_size if tr.eval_interval else 0
    train, valid, _ = build_datasets(
        cfg,
        tokenizer,
        (tr.train_iters * tr.global_batch_size, valid_samples, 0),
        is_built_on_rank=lambda: True,
        writer=writer,
    )
    if env.is_main:
        barrier()
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    return RunData(tokenizer=tokenizer, vocab_size=vocab_size, train=train, valid=valid)


def run_loader(cfg: RunConfig, dataset, consumed_samples: int = 0, num_workers: Optional[int] = None):
    """The micro-batch loader training reads `dataset` with (this rank's share, the run's seed);
    `num_workers` worker processes, data.num_workers unless given."""
    return build_loader(
        dataset,
        micro_batch_size=cfg.training.micro_batch_size,
        consumed_samples=consumed_samples,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        num_workers=cfg.data.num_workers if num_workers is None else num_workers,
        seed=cfg.training.seed,
    )


# --- the model wrapped for training


def _wrap_chunk(model, use_distributed_optimizer: bool, first: bool, overlap_grad_reduce: bool,
                overlap_param_gather: bool, bucket_size: Optional[int]) -> DistributedDataParallel:
    if model.config.bf16 or model.config.fp16:
        # Megatron-LM's wrapper: 16-bit parameters, fp32 inputs cast on the way in, logits back to fp32.
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    # as Megatron-LM's get_model: only the first chunk's buffers are split into buckets
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                  disable_bucketing=not first)
    # Reduced from the whole buffer after backward (no overlap), no parameter needs its backward hook
    # to fire: kernels may then add weight gradients into main_grad outside autograd (the sparse
    # experts do; see moe/experts/sparse.py). In overlap each hook marks its bucket ready.
    for param in ddp.module.parameters():
        set_main_grad_only(param, not ddp_config.overlap_grad_reduce)
    return ddp


def wrap_for_training(model, use_distributed_optimizer: bool = False, *, overlap_grad_reduce: bool = False,
                      overlap_param_gather: bool = False, bucket_size: Optional[int] = None):
    """`model`: one module (returns its wrapper) or a list of chunks (returns a list of wrappers).

    With `overlap_grad_reduce` each bucket of `bucket_size` elements is reduced as soon as its
    gradients are complete in the step's last micro-batch, and with `overlap_param_gather` (the
    distributed optimizer) each bucket's parameters are gathered in the next forward, as
    Megatron-LM's --overlap-grad-reduce and --overlap-param-gather: the model config gets the
    schedules' hooks (no_sync for the earlier micro-batches, a bucket reduction per chunk).
    """
    chunks = model if isinstance(model, list) else [model]
    wrapped = [_wrap_chunk(chunk, use_distributed_optimizer, i == 0, overlap_grad_reduce, overlap_param_gather,
                           bucket_size) for i, chunk in enumerate(chunks)]
    if overlap_grad_reduce:
        config = get_model_config(wrapped[0])
        # as Megatron-LM's training.py (align_grad_reduce, its default)
        config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
        config.grad_sync_func = ([c.start_grad_sync for c in wrapped] if len(wrapped) > 1
                                 else wrapped[0].start_grad_sync)
    return wrapped if isinstance(model, list) else wrapped[0]


@contextlib.contextmanager
def parameters_gathered(chunks):
    """The parameters whole on every rank while the block runs (evaluation, a checkpoint save): with
    overlap_param_gather the optimizer leaves their all-gather to the next forward's hooks, so, as
    Megatron-LM does, the hooks come off (gathering at once) and go back on after."""
    hooked = [chunk for chunk in chunks if getattr(chunk, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def release_after_training(chunks) -> None:
    """Break the two reference cycles that run through autograd's C++ nodes, which the garbage
    collector cannot see, so a finished run's model, optimizer and process groups (three gloo
    threads each) are freed: megatron's wrapper keeps each parameter's gradient accumulator, whose
    backward hook holds the wrapper; and the model config's loss-scale hook (set by train_step)
    holds the optimizer (its overlap hooks, the wrappers), whose distributed shards are views with autograd history."""
    for chunk in chunks:
        chunk.grad_accs.clear()
        config = get_model_config(chunk)
        config.grad_scale_func = config.no_sync_func = config.grad_sync_func = None


# --- the first lines of a run: on what device, what data, how big a model


def human_count(n: float) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return f"{n:.0f}"


def describe_device(cfg: RunConfig, env: DistEnv) -> str:
    precision = "bf16" if cfg.training.bf16 else "fp16" if cfg.training.fp16 else "fp32"
    name = torch.cuda.get_device_name(env.device) if env.on_cuda else "cpu"
    processes = f"{env.world_size} process" + ("es" if env.world_size > 1 else "")
    backend = dist.get_backend() if dist.is_initialized() else "none"
    return f"{name}, {processes} ({backend}), {precision}"


def describe_data(cfg: RunConfig, data) -> str:
    if cfg.data.data_path:
        source = f"{' '.join(cfg.data.data_path)} (tokenizer {cfg.data.tokenizer_model})"
    else:
        source = (f"built-in corpus (Python standard library; tokenizer vocabulary "
                  f"{cfg.data.builtin_vocab_size})")
    valid = f", {len(data.valid)} validation" if data.valid is not None else ""
    seen, per_pass = len(data.train), sequences_per_pass(data.train)
    # the training steps read more sequences than the split holds: megatron-core repeats it
    repeats = (f" ({per_pass} per pass over the split: its tokens are read about {seen / per_pass:.1f} times)"
               if per_pass and seen > per_pass else "")
    return f"{source}: {seen} training{repeats}{valid} sequences of {cfg.model.seq_length} tokens"


def parameter_counts(model, cfg: RunConfig, device: torch.device) -> Tuple[int, int]:
    """(all parameters, parameters each token passes through) of the whole model, all ranks.

    Expert weights (`is_expert_parallel`) are summed over the expert-parallel and expert-tensor-
    parallel ranks, tensor-parallel slices over the tensor-parallel ranks, and everything over pipeline
    stages. A token passes through top_k of num_experts experts in each MoE layer.
    """
    split = replicated = expert = 0
    chunks = [model] if isinstance(model, torch.nn.Module) else model  # or its virtual-stage chunks
    for param in (p for chunk in chunks for p in chunk.parameters()):
        if getattr(param, "shared", False):
            continue  # the last pipeline stage's copy of tied embeddings
        if is_expert_parallel(param):
            expert += param.numel()
        elif is_tensor_parallel(param):
            split += param.numel()
        else:
            replicated += param.numel()
    counts = [torch.tensor([float(c)], dtype=torch.float64, device=device) for c in (split, replicated, expert)]
    if dist.is_initialized():
        dist.all_reduce(counts[0], group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(counts[2], group=ps.get_expert_tensor_and_model_parallel_group())
        for c in counts:
            dist.all_reduce(c, group=ps.get_pipeline_model_parallel_group())
    dense, experts = counts[0].item() + counts[1].item(), counts[2].item()
    active = experts * cfg.moe.top_k / cfg.moe.num_experts if cfg.moe.num_experts else 0
    return int(dense + experts), int(dense + active)


def describe_model(model, cfg: RunConfig, device: torch.device) -> str:
    total, active = parameter_counts(model, cfg, device)
    moe = (f", {cfg.moe.num_experts} experts, top-{cfg.moe.top_k}" if cfg.moe.num_experts
           else ", dense")
    return (f"{human_count(total)} parameters, {human_count(active)} active per token "
            f"({cfg.model.num_layers} layers x {cfg.model.hidden_size}{moe})")
