#!/usr/bin/env python
"""Training throughput of GPT models: dense, dMoE and capacity-factor MoE in one run, on one device
or on the GPUs of one host.

The dMoE runs in several forms: expert weight gradients accumulated per micro-batch (the default), once
per step (dmoe-per-step, moe.expert_wgrad_per_step: true), with random router logits
(dmoe-balanced, moe.router_force_load_balancing: true), and so over the NVSHMEM exchange that
expert parallelism across hosts takes (dmoe-nvshmem, moe.ep_exchange: nvshmem) or with the weight
gradients once per window of micro-batches (dmoe-window, moe.expert_wgrad_window: --wgrad-window). A fresh router on
synthetic tokens sends most of a layer's tokens to a few experts (its inputs share one large
component); dmoe-balanced loads every expert evenly, as a trained router's load-balancing loss does:
with expert parallelism the two bracket what training sees, since an overloaded rank makes the
others wait at every exchange.

Each model trains for --warmup steps, then --steps timed steps of one global batch (micro-batches
accumulated as in training) on synthetic tokens, with the same optimizer, mixed precision and DDP
wrapper as `dmoe-train`. Reported per GPU: tokens/s, model TFLOP/s (active parameters only: one
expert per token for top-1, plus attention and logits; see megatron_dmoe.training.flops), MFU
against a bf16 matmul (8192^3) measured in the same run, the ratio to the dense model's tokens/s and
peak memory. Prints a table and writes JSON (--out).

Several GPUs (--nproc-per-node N): this process launches `torchrun --standalone --nproc_per_node N`
of this program with --in-process, once per model and mode on CUDA (a fresh CUDA context, rendezvous
and set of process groups for each; nothing of one model can crowd the next), once for all models
on CPU (gloo; nothing to isolate). Rank 0 of each launch writes its rows and this process gathers
them. Every model gets the same N processes and the same global batch: the dense model and the
capacity-factor MoE run data parallel over all of them, the dMoE models with
parallel.expert_model_parallel_size = --ep (expert parallelism nested in data parallelism). Step
time and peak memory are the largest over the ranks. A model and mode that the configuration check
refuses (training.cuda_graphs with the NCCL expert exchange, say) becomes a row with the reason; a
launch that fails becomes a row with the end of its output, and the program exits with status 1
after printing the table.

Started by torchrun directly (or with --in-process), every rank runs every model in-process,
megatron's process groups rebuilt for each model's expert-parallel size. Otherwise each model and
mode runs in a fresh child process, on one GPU or CPU as in the multi-GPU launches: a run that fails
(CUDA out of memory, say: its row names the allocation torch reported) stays that run's row and the
next run starts afresh.

--zoo runs the zoo's Small configs exactly as shipped (ZOO_MODELS: their batch, precision, tokenizer
vocabulary and defaults, training.cuda_graphs: auto resolved as dmoe-train does) instead of the models
above.

  python tools/bench_train.py                       # dense, dMoE (twice) and capacity-1.0 Small, bf16
  python tools/bench_train.py --models dmoe --set moe.backend=grouped
  python tools/bench_train.py --nproc-per-node 2 --ep 2 --models dense,dmoe,capacity --cuda-graphs both
  python tools/bench_train.py --zoo --cuda-graphs both --out zoo.json   # the zoo's Small models as shipped
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_breakdown, beside this file

MODELS = {
    "dense": "zoo/dense_small",
    "dmoe": "zoo/dmoe_small",
    "dmoe-per-step": "zoo/dmoe_small",
    "dmoe-balanced": "zoo/dmoe_small",
    "dmoe-nvshmem": "zoo/dmoe_small",
    "dmoe-window": "zoo/dmoe_small",
    "capacity": "zoo/capacity1.0_small",
}
# Overrides that make a named model differ from its config (before --set's). The MoE models keep
# the paper's layout, every layer MoE (the zoo's Small MoE models have three dense first layers),
# so that the figures compare with earlier runs and measure the MoE layer where it costs most.
ALL_MOE = "moe.first_dense_layers=0"
MODEL_OVERRIDES = {
    "dmoe": [ALL_MOE],
    "dmoe-per-step": [ALL_MOE, "moe.expert_wgrad_per_step=true"],  # expert weight gradients once per step
    "capacity": [ALL_MOE],
    # random router logits (moe.router_force_load_balancing): every expert, and so every expert-parallel
    # rank, evenly loaded, as a trained router's load-balancing loss makes them; a fresh router on
    # synthetic tokens sends most tokens of a layer to a few experts instead
    "dmoe-balanced": [ALL_MOE, "moe.router_force_load_balancing=true"],
    # dmoe-balanced over the NVSHMEM exchange, the one expert parallelism across hosts takes
    "dmoe-nvshmem": [ALL_MOE, "moe.router_force_load_balancing=true", "moe.ep_exchange=nvshmem"],
    # dmoe-balanced with the expert weight gradients once per window of --wgrad-window micro-batches
    "dmoe-window": [ALL_MOE, "moe.router_force_load_balancing=true"],
}
NOT_BY_DEFAULT = ("dmoe-nvshmem", "dmoe-window")
# Models that run eagerly only: captured layers accumulate weight gradients per micro-batch.
WITHOUT_GRAPHS = {"dmoe-per-step"}
# --zoo: the zoo's Small configs exactly as shipped (their batch, precision and defaults; --set's
# overrides still apply), and the dMoE with 8 experts: the expert parameters and tokens per expert
# one GPU holds when the 64-expert model runs at expert parallelism 8.
ZOO_MODELS = {
    "zoo-dense": ("zoo/dense_small", []),
    "zoo-dmoe": ("zoo/dmoe_small", []),
    "zoo-dmoe-all-moe": ("zoo/dmoe_small", [ALL_MOE]),
    "zoo-dmoe-8x": ("zoo/dmoe_small", ["moe.num_experts=8"]),
    # training.fp8: blockwise beside them (Hopper or newer; named, not by default)
    "zoo-dense-fp8": ("zoo/dense_small", ["training.fp8=blockwise"]),
    "zoo-dmoe-fp8": ("zoo/dmoe_small", ["training.fp8=blockwise"]),
}
ZOO_NOT_BY_DEFAULT = ("zoo-dense-fp8", "zoo-dmoe-fp8")
DEFAULT_VOCAB = 50257  # GPT-2's


def vocab_size(args, cfg) -> int:
    """The synthetic tokens' vocabulary: --vocab-size, else the zoo config's tokenizer (--zoo), else GPT-2's."""
    if args.vocab_size is not None:
        return args.vocab_size
    return cfg.data.builtin_vocab_size if args.zoo else DEFAULT_VOCAB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma-separated names from {sorted(MODELS)} or config names (default: all but "
                        f"{' and '.join(NOT_BY_DEFAULT)}; dmoe-per-step is the dMoE with moe.expert_wgrad_per_step: "
                        f"true, dmoe-balanced with moe.router_force_load_balancing: true, dmoe-nvshmem that over "
                        f"moe.ep_exchange: nvshmem, dmoe-window that with moe.expert_wgrad_window: --wgrad-window); "
                        f"with --zoo, names "
                        f"from {sorted(ZOO_MODELS)} (default: all)")
    p.add_argument("--wgrad-window", type=int, default=4, metavar="W",
                   help="dmoe-window's moe.expert_wgrad_window: micro-batches per expert weight-gradient window "
                        "(default 4; must divide the micro-batches of a step)")
    p.add_argument("--zoo", action="store_true",
                   help="run the zoo's Small configs exactly as shipped: dense_small, dmoe_small, dmoe_small with "
                        "every layer MoE and with 8 experts (EP = 8's per-GPU part), each with its own batch, "
                        "precision and defaults (training.cuda_graphs: auto unless --cuda-graphs says otherwise); "
                        "--micro-batch-size, --global-batch-size, --seq-length, --precision and --ep do not apply")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per model (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch (default 16)")
    p.add_argument("--global-batch-size", type=int, default=128,
                   help="sequences per optimizer step (default 128: 8 micro-batches of 16, so the "
                        "optimizer step is amortised as in real training)")
    p.add_argument("--seq-length", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary of the synthetic tokens (default {DEFAULT_VOCAB}; with --zoo, the configs' own: "
                        "data.builtin_vocab_size, the built-in tokenizer's)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 (CUDA, fp32 master weights) or fp32 (any device)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to run")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides applied to every model, e.g. moe.backend=grouped")
    p.add_argument("--cuda-graphs", choices=("off", "on", "both", "auto"), default=None,
                   help="capture the transformer layers as CUDA graphs (training.cuda_graphs): off, on, "
                        "both (each model twice; rows of graphed runs are marked '+graphs') or auto (as "
                        "dmoe-train resolves its default: on where capture is correct). Default: off; "
                        "with --zoo, auto")
    p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul reference (MFU left out)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, profile one more step of each model (torch.profiler, CUDA only): "
                        "report GPU busy time against the step's wall time (a large gap means the host "
                        "cannot issue work fast enough), and write DIR/<model>_kernels.txt (kernels by "
                        "GPU time) and DIR/<model>_trace.json (chrome://tracing); a graphed row's files are "
                        "<model>_graphs_*")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run every model on N processes of this host (N GPUs, or N gloo processes on CPU): "
                        "this process launches torchrun --standalone --nproc_per_node N of this program per "
                        "model and mode on CUDA (once for all models on CPU) and gathers rank 0's rows; "
                        "start it without torchrun")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="parallel.expert_model_parallel_size of the dropless MoE models (dmoe, dmoe-per-step; "
                        "default 1); dense and capacity-factor models stay data parallel. --set "
                        "parallel.expert_model_parallel_size=N applies to every model instead")
    p.add_argument("--in-process", action="store_true",
                   help="run every model in this process, under torchrun or not (default on CUDA: each "
                        "model in a fresh child process, so that one model's memory and captured graphs "
                        "cannot crowd the next)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = p.parse_args(argv)
    if args.zoo:
        unknown = [m for m in (args.models or "").split(",") if m.strip() and m.strip() not in ZOO_MODELS]
        if unknown:
            p.error(f"--models {','.join(unknown)} with --zoo: use names from {sorted(ZOO_MODELS)}")
        if args.ep != 1:
            p.error("--ep with --zoo: the zoo's configs run as shipped; drop --ep (zoo-dmoe-8x is the "
                    "per-GPU part of expert parallelism 8)")
    # dmoe-nvshmem differs from dmoe-balanced only where experts are spread (--ep): named, not by default
    default = [m for m in ZOO_MODELS if m not in ZOO_NOT_BY_DEFAULT] if args.zoo else \
        [m for m in MODELS if m not in NOT_BY_DEFAULT]
    args.models = args.models or ",".join(default)
    args.cuda_graphs = args.cuda_graphs or ("auto" if args.zoo else "off")
    if args.ep < 1:
        p.error(f"--ep: {args.ep} is not a process count; use 1 (no expert parallelism) or more")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        p.error(f"--nproc-per-node: {args.nproc_per_node} processes; use 1 or more")
    if args.nproc_per_node is not None and not args.in_process and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        p.error("--nproc-per-node launches torchrun itself: start this program without torchrun, or drop "
                "--nproc-per-node to run every model in-process on torchrun's ranks")
    return args


def matmul_tflops(device: torch.device) -> float:
    """Measured bf16 dense matmul rate, the MFU denominator."""
    import triton.testing

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _cuda_matmul_tflops() -> float:
    return matmul_tflops(torch.device("cuda"))


def matmul_tflops_in_child() -> float:
    """matmul_tflops in a process of its own, so that this one never holds a CUDA context (most of a
    GiB) beside the runs it launches: the largest models fill an 80 GB card."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_cuda_matmul_tflops).result()


def synthetic_batches(cfg, vocab_size: int, device: torch.device, rank: int = 0, count: int = 4):
    """A few fixed random micro-batches, cycled (data loading is not what is measured); each rank
    draws its own, as data-parallel ranks read different samples."""
    g = torch.Generator().manual_seed(rank)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab_size, (b, s + 1), generator=g)
        batches.append({
            "tokens": tokens[:, :-1].to(device),
            "labels": tokens[:, 1:].to(device),
            "loss_mask": torch.ones(b, s, device=device),
            "position_ids": torch.arange(s, device=device).expand(b, s).contiguous(),
        })
    while True:
        yield from batches


def model_runs(args) -> list:
    """(name, cuda_graphs) in the order they run: every model eagerly, then graphed; cuda_graphs is
    None for auto (resolved from the config, see plan_runs)."""
    modes = {"off": [False], "on": [True], "both": [False, True], "auto": [None]}[args.cuda_graphs]
    return [(name.strip(), graphs) for graphs in modes for name in args.models.split(",")
            if name.strip() and not (graphs and name.strip() in WITHOUT_GRAPHS)]


def model_config(name: str, args, device_type: str, cuda_graphs):
    """The resolved config of one model and mode (not validated). --ep goes to dropless MoE models
    only, before --set's (which win). cuda_graphs None keeps the config's training.cuda_graphs."""
    from megatron_dmoe.config import load_config, resolve

    graphs = [] if cuda_graphs is None else [f"training.cuda_graphs={'true' if cuda_graphs else 'false'}"]
    if args.zoo:  # as shipped, on this machine's device
        config_name, extra = ZOO_MODELS[name]
        return resolve(load_config(config_name, [f"training.device={device_type}", *extra, *graphs, *args.set]))
    gbs = args.global_batch_size or args.micro_batch_size
    overrides = [
        f"model.seq_length={args.seq_length}",
        f"training.micro_batch_size={args.micro_batch_size}",
        f"training.global_batch_size={gbs}",
        f"training.bf16={'true' if args.precision == 'bf16' else 'false'}",
        f"training.device={device_type}",
        "training.lr_warmup_iters=0",
        *graphs,
        *MODEL_OVERRIDES.get(name, []),
        *([f"moe.expert_wgrad_window={args.wgrad_window}"] if name == "dmoe-window" else []),
    ]
    config_name = MODELS.get(name, name)
    cfg = resolve(load_config(config_name, overrides + args.set))
    if args.ep != 1 and cfg.moe.num_experts > 0 and cfg.moe.expert_capacity_factor is None:
        ep = [f"parallel.expert_model_parallel_size={args.ep}"]
        cfg = resolve(load_config(config_name, overrides + ep + args.set))
    return cfg


def plan_runs(args, device_type: str, world_size: int) -> list:
    """Every run's config, checked before anything is measured: (name, cuda_graphs, cfg, refusal),
    refusal being the configuration check's message for a combination it refuses, else None. A
    config that cannot be read at all (no such file, a malformed override) stops here."""
    from megatron_dmoe.config import ConfigError, validate
    from megatron_dmoe.model.cuda_graphs_auto import resolve_cuda_graphs

    plan = []
    for name, graphs in model_runs(args):
        try:
            cfg = model_config(name, args, device_type, graphs)
        except ConfigError as err:
            raise SystemExit(f"bench_train: --models {name!r} (a name from {sorted(MODELS)} or a config): {err}")
        try:
            validate(cfg, world_size=world_size)
            refusal = None
        except ConfigError as err:
            refusal = " ".join(str(err).split())
        if refusal is None:  # training.cuda_graphs: auto becomes true or false, as in dmoe-train
            cfg, notes = resolve_cuda_graphs(cfg, device_type == "cuda", world_size, world_size)
            for note in (notes if not args.in_process else []):
                print(f"bench_train: {name}: {note}", flush=True)
        graphs = cfg.training.cuda_graphs is True
        plan.append((name, graphs, cfg, refusal))
    return plan


def profile_stem(name: str) -> str:
    """A profiled run's file names: its row's name, '+graphs' as '_graphs' (a '+' is awkward in paths)."""
    return name.replace("+", "_")


def run_row(name: str, cuda_graphs: bool, cfg, world_size: int) -> dict:
    """What every row says about its run, measured or not."""
    par = cfg.parallel
    return {
        "model": name + ("+graphs" if cuda_graphs else ""),
        "cuda_graphs": cuda_graphs,
        "config": MODELS.get(name, name),
        "dense": cfg.moe.num_experts == 0,  # a row the others are compared with
        "world_size": world_size,
        "expert_model_parallel_size": par.expert_model_parallel_size,
        "data_parallel_size": world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size),
        "global_batch_size": cfg.training.global_batch_size,
        "micro_batch_size": cfg.training.micro_batch_size,
        "seq_length": cfg.model.seq_length,
    }


def failure_row(row: dict, returncode: int, output: str) -> dict:
    """A failed child's row: the end of its output, and for CUDA running out of memory a short reason
    with the allocation torch reported (`oom_requested`, e.g. '2.00 GiB')."""
    from megatron_dmoe.training.out_of_memory import allocation_asked

    row = dict(row, error=f"exit status {returncode}: {output[-2000:]}")
    asked = allocation_asked(output) if "CUDA out of memory" in output else None
    if asked or "OutOfMemoryError" in output:
        row["oom"] = True
        row["oom_requested"] = asked
        row["reason"] = "CUDA out of memory" + (f" (tried to allocate {asked})" if asked else "")
    return row


def _max_over_ranks(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _global_params(model) -> int:
    """Parameters of the whole model: expert weights (expert-parallel) are split over the
    expert-parallel ranks, every other weight is whole on each rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dmoe.parallel.param_roles import is_expert_parallel

    expert = sum(p.numel() for p in model.parameters() if is_expert_parallel(p))
    other = sum(p.numel() for p in model.parameters() if not is_expert_parallel(p))
    t = torch.tensor([expert], dtype=torch.float64, device=next(model.parameters()).device)
    dist.all_reduce(t, group=ps.get_expert_model_parallel_group())
    return int(t.item()) + other


def bench_model(name: str, args, cfg, cuda_graphs: bool = False) -> dict:
    """Train one model (an already checked config) on this process's ranks; every rank calls it."""
    from megatron_dmoe.config.overlap_rules import resolve_overlap
    from megatron_dmoe.model.gpt import build_gpt_model, padded_vocab_size
    from megatron_dmoe.moe import MoERunState
    from megatron_dmoe.parallel.distributed import init_distributed, seed_everything
    from megatron_dmoe.training.cuda_graphs import release_layer_graphs, uses_captured_layers
    from megatron_dmoe.training.flops import model_flops_per_token
    from megatron_dmoe.training.optim import build_optimizer
    from megatron_dmoe.training.setup import resolve_window, wrap_for_training
    from megatron_dmoe.training.step import mean_over_data_parallel, train_step

    par = cfg.parallel
    # megatron's groups for this model's parallel sizes (the default process group is kept)
    env = init_distributed(cfg.training.device, par.tensor_model_parallel_size,
                           par.pipeline_model_parallel_size, par.expert_model_parallel_size)
    seed_everything(cfg.training.seed, env, cuda_graphs=cfg.training.cuda_graphs)
    vocab = vocab_size(args, cfg)
    # moe.expert_wgrad_window: auto decided as dmoe-train decides it, for this GPU's memory
    tell = lambda note: env.is_main and print(f"bench_train: {name}: {note}", flush=True)  # noqa: E731
    cfg = resolve_window(cfg, env, vocab, tell)
    # parallel.overlap_*: auto too, once the graphs and the window are decided, as in dmoe-train
    cfg, overlap_notes = resolve_overlap(cfg, env.on_cuda, env.world_size, env.local_world_size)
    for note in overlap_notes:
        tell(note)
    par = cfg.parallel
    run_state = MoERunState()
    run_state.wgrad.use_window(cfg.moe.expert_wgrad_window)
    run_state.metrics.megatron_tracker = False  # as dmoe-train: its loop logs MoE metrics itself
    model = wrap_for_training(build_gpt_model(cfg, vocab_size=vocab, on_cuda=env.on_cuda, run_state=run_state),
                              overlap_grad_reduce=par.overlap_grad_reduce is True, bucket_size=par.ddp_bucket_size)
    optimizer = build_optimizer(cfg, [model], env.on_cuda)
    gbs = cfg.training.global_batch_size
    micro_batches = gbs // (cfg.training.micro_batch_size * env.world_size)
    per_step = cfg.moe.expert_wgrad_per_step
    # training.cuda_graphs: auto, as dmoe-train: graphs whose pool does not fit go back to eager
    must_fit = cuda_graphs and args.cuda_graphs == "auto"
    data = synthetic_batches(cfg, vocab, env.device, rank=env.rank)
    sync = torch.cuda.synchronize if env.on_cuda else (lambda: None)
    if env.on_cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        train_step(model, optimizer, data, micro_batches, env.device, run_state, per_step, must_fit)
    sync()
    step_seconds = []  # each timed step on its own, for the spread; the slowest rank sets each
    for _ in range(args.steps):
        start = time.perf_counter()
        loss, _, _ = train_step(model, optimizer, data, micro_batches, env.device, run_state, per_step, must_fit)
        sync()
        step_seconds.append(_max_over_ranks(time.perf_counter() - start, env.device))
    seconds = sum(step_seconds) / len(step_seconds)
    result = run_row(name, cuda_graphs, cfg, env.world_size)
    if cuda_graphs and not uses_captured_layers([model]):  # auto found no room for them: ran eagerly
        result.update(model=result["model"] + " (auto: eager)", graphs_dropped=True)
    label = result["model"] + (f"_rank{env.rank}" if env.world_size > 1 else "")
    def step():
        return train_step(model, optimizer, data, micro_batches, env.device, run_state, per_step, must_fit)

    profile = profile_step(label, args.profile, step, sync) if args.profile and env.on_cuda else None
    if profile is not None and cfg.moe.num_experts > 0:
        from step_breakdown import expert_wgrad_flops

        profile["wgrad_flops"] = expert_wgrad_flops(cfg, gbs * cfg.model.seq_length // env.world_size)
    peak_memory = _max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, env.device) if env.on_cuda else None
    tokens_per_s = gbs * cfg.model.seq_length / seconds
    flops = model_flops_per_token(cfg, vocab_size=padded_vocab_size(vocab, cfg))
    result.update({
        "ms_per_step": seconds * 1e3,
        "step_ms": [t * 1e3 for t in step_seconds],
        "wgrad_window": cfg.moe.expert_wgrad_window,
        "tokens_per_s": tokens_per_s / env.world_size,
        "tflops_per_gpu": flops * tokens_per_s / env.world_size / 1e12,
        "final_loss": mean_over_data_parallel(loss),
        "peak_memory_gib": peak_memory,
        "params": _global_params(model),
        "profile": profile,
    })
    model = optimizer = step = None  # free them: the profiled step holds these names
    if cuda_graphs:
        release_layer_graphs()
    gc.collect()
    if env.on_cuda:
        torch.cuda.empty_cache()
    return result


def row_line(row: dict) -> str:
    """One finished run in a line, printed as it finishes (the table comes at the end)."""
    head = f"bench_train: {row['model']} done:"
    if "tokens_per_s" in row:
        return f"{head} {row['ms_per_step']:.1f} ms a step, {row['tokens_per_s']:,.0f} tokens/s per GPU"
    return f"{head} {row.get('reason') or 'failed'}"


def bench_in_children(plan: list, argv: list, nproc: int | None, on_cuda: bool, auto: bool = False,
                      finished=None) -> list:
    """Rows of the planned runs, each measured by a child: one plain process (nproc None) or
    torchrun --standalone with nproc processes, started from this run's own arguments and then the
    model and mode it runs (argparse keeps the last value of an option). One child per run: a run that
    fails (CUDA out of memory, say) is that run's row, and the next run starts afresh. Refused runs
    become rows here. finished(rows so far), if given, is called after each child: a run stopped
    from outside keeps what it measured."""
    import tempfile

    world_size = nproc or 1
    rows = {}
    batches = []
    for name, graphs, cfg, refusal in plan:
        if refusal is not None:
            rows[(name, graphs)] = dict(run_row(name, graphs, cfg, world_size), refused=refusal)
        else:
            batches.append((graphs, [name]))
    # a one-process run of its own (or torchrun's own ranks), even when this process was started by torchrun
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
    for graphs, names in batches:
        # auto: the child resolves it alike, and may drop graphs whose memory pool does not fit
        mode = "auto" if auto else "on" if graphs else "off"
        print(f"bench_train: {','.join(names)} (cuda graphs {mode}) on {world_size} process(es)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/result.json"
            start = [sys.executable] if nproc is None else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
            child = [*start, os.path.abspath(__file__), *argv, "--models", ",".join(names), "--cuda-graphs", mode,
                     "--in-process", "--no-matmul", "--out", out]
            done = _run_child(child, env, out, f"{tmp}/output.txt")
            if done.returncode == 0 or (done.teardown_hung and os.path.exists(out)):
                with open(out) as f:
                    for r in json.load(f)["results"]:
                        rows[(r["model"].split("+")[0], r["cuda_graphs"])] = r
            else:
                print(done.stdout[-4000:], flush=True)
                for name in names:
                    cfg = next(c for n, g, c, _ in plan if n == name and g == graphs)
                    rows[(name, graphs)] = failure_row(run_row(name, graphs, cfg, world_size), done.returncode,
                                                       done.stdout)
        for name in names:
            print(row_line(rows[(name, graphs)]), flush=True)
        if finished is not None:
            finished(list(rows.values()))
    return [rows.get((name, graphs)) or dict(run_row(name, graphs, cfg, world_size),
                                              error="the child exited without a row for this run")
            for name, graphs, cfg, _ in plan]


TEARDOWN_GRACE_S = 120  # how long a child may take to exit once it has written its rows


def _run_child(child: list, env: dict, result_file: str, output_file: str):
    """Run one child launch to its end: (returncode, stdout, teardown_hung). A child writes its rows
    before it tears its process groups down; one still running TEARDOWN_GRACE_S after that is
    killed, its rows kept (a teardown that hangs must not cost the measurements)."""
    import signal
    import subprocess
    import time
    from types import SimpleNamespace

    hung = False
    with open(output_file, "w") as log:
        proc = subprocess.Popen(child, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        written_at = None
        while proc.poll() is None:
            time.sleep(1.0)
            if written_at is None and os.path.exists(result_file):
                written_at = time.monotonic()
            if written_at is not None and time.monotonic() - written_at > TEARDOWN_GRACE_S:
                hung = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    with open(output_file) as f:
        output = f.read()
    if hung:
        print(f"bench_train: the launch wrote its rows but had not exited {TEARDOWN_GRACE_S} s later "
              "(process-group teardown); killed, rows kept", flush=True)
    return SimpleNamespace(returncode=proc.returncode, stdout=output, teardown_hung=hung)


def profile_step(name: str, out_dir: str, step, sync) -> dict:
    """One step under torch.profiler: wall time, summed kernel time and the kernels by GPU time."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    # user annotations (the optimizer's step range, say) appear as device events too: not kernels
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and not e.key.startswith("Optimizer.")]
    busy_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"{'GPU ms':>9s} {'%':>6s} {'calls':>7s}  kernel"]
    lines += [f"{e.self_device_time_total / 1e3:9.2f} {100 * e.self_device_time_total / max(busy_us, 1):6.1f} "
              f"{e.count:7d}  {e.key[:140]}" for e in kernels]
    (out / f"{profile_stem(name)}_kernels.txt").write_text("\n".join(lines) + "\n")
    prof.export_chrome_trace(str(out / f"{profile_stem(name)}_trace.json"))
    from step_breakdown import breakdown

    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy_us / 1e3, "kernel_launches": sum(e.count for e in kernels),
            "top_kernels": [(e.key[:100], e.self_device_time_total / 1e3, e.count) for e in kernels[:15]],
            "parts": breakdown((e.key, e.self_device_time_total / 1e3, e.count) for e in kernels)}


def print_table(results: list, peak: float | None) -> None:
    measured = [r for r in results if "tokens_per_s" in r]

    def dense_for(r):  # the dense run of the same mode (eager or graphed), else any dense run
        dense = [d for d in measured if d["dense"]]
        return ([d for d in dense if d["cuda_graphs"] == r["cuda_graphs"]] or dense or [None])[0]

    header = (f"{'model':23s} {'EP':>3s} {'params':>8s} {'ms/step':>9s} {'spread':>7s} {'W':>2s} "
              f"{'tokens/s/GPU':>13s} {'TFLOP/s':>8s} {'MFU':>6s} {'vs dense':>9s} {'peak GiB':>9s}")
    print(header)
    print("-" * len(header))
    for r in results:
        head = f"{r['model']:23s} {r['expert_model_parallel_size']:3d}"
        if "tokens_per_s" not in r:
            why = (f"refused: {r['refused']}" if "refused" in r else f"failed: {r['reason']}" if r.get("reason")
                   else "failed (output above; JSON has its end)")
            print(f"{head} {why}")
            continue
        mfu = f"{100 * r['tflops_per_gpu'] / peak:5.1f}%" if peak else "   n/a"
        dense = dense_for(r)
        rel = f"{r['tokens_per_s'] / dense['tokens_per_s']:8.2f}x" if dense else "      n/a"
        mem = f"{r['peak_memory_gib']:9.1f}" if r["peak_memory_gib"] is not None else "      n/a"
        print(f"{head} {r['params'] / 1e6:7.0f}M {r['ms_per_step']:9.1f} {spread_text(r):>7s} "
              f"{r.get('wgrad_window', 1):2d} {r['tokens_per_s']:13,.0f} {r['tflops_per_gpu']:8.1f} {mfu} {rel} {mem}")
    print("spread: (slowest - fastest timed step) / mean step; W: moe.expert_wgrad_window as resolved")


def spread_text(row: dict) -> str:
    """The timed steps' range over their mean, as a percentage."""
    steps = row.get("step_ms") or []
    if len(steps) < 2:
        return "n/a"
    return f"{100 * (max(steps) - min(steps)) / row['ms_per_step']:.1f}%"


def write_results(args, peak, world_size: int, results: list, complete: bool, gpu: str | None = None) -> None:
    """--out's JSON; written after each child's run too (complete: false), so a run stopped from
    outside keeps what it measured. gpu: the device's name, asked for only at the end (a CUDA
    context in this process would take GPU memory from the runs still to come)."""
    if not args.out:
        return
    versions = {"torch": torch.__version__, **({"gpu": gpu} if gpu else {})}
    with open(args.out, "w") as f:
        json.dump({"matmul_tflops": peak, "versions": versions, "world_size": world_size, "complete": complete,
                   "args": vars(args), "results": results}, f, indent=2)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, resolve_device

    device_type = resolve_device(args.device)
    if device_type == "cuda" and (args.nproc_per_node or 0) > torch.cuda.device_count():
        raise SystemExit(f"bench_train: --nproc-per-node {args.nproc_per_node} but {torch.cuda.device_count()} "
                         "GPU(s) are visible here; use at most that many (one process per GPU)")
    launched_world = int(os.environ.get("WORLD_SIZE", 1))
    # each run in a process of its own, on any device, unless --in-process or started by torchrun
    one_process_children = launched_world == 1 and len(model_runs(args)) > 1
    in_children = not args.in_process and (args.nproc_per_node is not None or one_process_children)
    world_size = (args.nproc_per_node or 1) if in_children else launched_world
    plan = plan_runs(args, device_type, world_size)
    if in_children:
        is_main = True
        peak = None if (args.no_matmul or device_type != "cuda") else matmul_tflops_in_child()
        results = bench_in_children(plan, argv, args.nproc_per_node, device_type == "cuda",
                                    auto=args.cuda_graphs == "auto",
                                    finished=lambda rows: write_results(args, peak, world_size, rows, complete=False))
    else:
        env = init_distributed(args.device)
        is_main = env.is_main
        failed = True
        try:
            peak = None if (args.no_matmul or not env.on_cuda) else matmul_tflops(env.device)
            results = [bench_model(name, args, cfg, graphs) if refusal is None
                       else dict(run_row(name, graphs, cfg, env.world_size), refused=refusal)
                       for name, graphs, cfg, refusal in plan]
            failed = False
            if is_main:  # before the teardown, which has hung (docs/performance.md, "The NVSHMEM exchange")
                write_results(args, peak, env.world_size, results, complete=True,
                              gpu=torch.cuda.get_device_name() if env.on_cuda else None)
        finally:
            # after a failure the other ranks may never arrive: abort instead of waiting for them
            destroy_distributed(abort=failed)
    if is_main:
        shapes = sorted({(r["global_batch_size"], r["micro_batch_size"], r["seq_length"]) for r in results})
        batches = ", ".join(f"global batch {g} (micro-batch {m}) x {s} tokens" for g, m, s in shapes)
        print(f"{world_size} process(es), {batches}; tokens/s and TFLOP/s per GPU (per process on CPU)")
        if peak:
            print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s (MFU denominator)")
        print_table(results, peak)
        for r in results:
            if r.get("profile"):
                prof = r["profile"]
                print(f"profile {r['model']}: step {prof['wall_ms']:.1f} ms wall (profiled), kernels "
                      f"{prof['gpu_busy_ms']:.1f} ms GPU ({100 * prof['gpu_busy_ms'] / prof['wall_ms']:.0f} % busy), "
                      f"{prof['kernel_launches']} launches; kernels by GPU time in {args.profile}/"
                      f"{profile_stem(r['model'] + ('_rank0' if world_size > 1 else ''))}_kernels.txt")
                if prof.get("parts"):
                    from step_breakdown import summary_lines

                    print("\n".join(summary_lines(prof["parts"], prof["wall_ms"], prof.get("wgrad_flops", 0.0))))
        write_results(args, peak, world_size, results, complete=True,
                      gpu=torch.cuda.get_device_name() if device_type == "cuda" else None)
    failures = [r["model"] for r in results if "error" in r]
    if failures or not any("tokens_per_s" in r for r in results):
        raise SystemExit(f"bench_train: failed: {', '.join(failures)}" if failures
                         else "bench_train: every run was refused (reasons in the table)")


if __name__ == "__main__":
    main()
