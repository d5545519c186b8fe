#!/usr/bin/env python
"""Training throughput of GPT models on one device: dense, dMoE and capacity-factor MoE in one run.

The dMoE runs twice: expert weight gradients accumulated per micro-batch (the default) and once per
step (dmoe-per-step, moe.expert_wgrad_per_step: true).

Each model trains for --warmup steps, then --steps timed steps of one global batch (micro-batches
accumulated as in training) on synthetic tokens, with the same optimizer, mixed precision and DDP
wrapper as `dmoe-train`. Reported: tokens/s, model TFLOP/s (active parameters only: one expert per
token for top-1, plus attention and logits; see megatron_dmoe.training.flops) and MFU against a
bf16 matmul (8192^3) measured in the same run. Prints a table and writes JSON (--out).

  python tools/bench_train.py                       # dense, dMoE (twice) and capacity-1.0 Small, bf16
  python tools/bench_train.py --models dmoe --set moe.backend=grouped
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

MODELS = {
    "dense": "zoo/dense_small",
    "dmoe": "zoo/dmoe_small",
    "dmoe-per-step": "zoo/dmoe_small",
    "capacity": "zoo/capacity1.0_small",
}
# Overrides that make a named model differ from its config (before --set's).
MODEL_OVERRIDES = {
    "dmoe-per-step": ["moe.expert_wgrad_per_step=true"],  # expert weight gradients once per step
}
# Models that run eagerly only: captured layers accumulate weight gradients per micro-batch.
WITHOUT_GRAPHS = {"dmoe-per-step"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="dense,dmoe,dmoe-per-step,capacity",
                   help=f"comma-separated names from {sorted(MODELS)} or config names (default: all four; "
                        "dmoe-per-step is the dMoE with moe.expert_wgrad_per_step: true)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per model (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch (default 16)")
    p.add_argument("--global-batch-size", type=int, default=128,
                   help="sequences per optimizer step (default 128: 8 micro-batches of 16, so the "
                        "optimizer step is amortised as in real training)")
    p.add_argument("--seq-length", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--vocab-size", type=int, default=50257, help="vocabulary of the synthetic tokens")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 (CUDA, fp32 master weights) or fp32 (any device)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to run")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides applied to every model, e.g. moe.backend=grouped")
    p.add_argument("--cuda-graphs", choices=("off", "on", "both"), default="off",
                   help="capture the transformer layers as CUDA graphs (training.cuda_graphs): off, on, "
                        "or both (each model twice; rows of graphed runs are marked '+graphs')")
    p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul reference (MFU left out)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, profile one more step of each model (torch.profiler, CUDA only): "
                        "report GPU busy time against the step's wall time (a large gap means the host "
                        "cannot issue work fast enough), and write DIR/<model>_kernels.txt (kernels by "
                        "GPU time) and DIR/<model>_trace.json (chrome://tracing)")
    p.add_argument("--in-process", action="store_true",
                   help="run every model in this process (default on CUDA: each model in a fresh child "
                        "process, so that one model's memory and captured graphs cannot crowd the next)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    return p.parse_args(argv)


def matmul_tflops(device: torch.device) -> float:
    """Measured bf16 dense matmul rate, the MFU denominator."""
    import triton.testing

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def synthetic_batches(cfg, vocab_size: int, device: torch.device, count: int = 4):
    """A few fixed random micro-batches, cycled (data loading is not what is measured)."""
    g = torch.Generator().manual_seed(0)
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


def bench_model(name: str, args, env, cuda_graphs: bool = False) -> dict:
    from megatron_dmoe.config import load_config, resolve, validate
    from megatron_dmoe.model.gpt import build_gpt_model, padded_vocab_size
    from megatron_dmoe.parallel.distributed import seed_everything
    from megatron_dmoe.training.flops import model_flops_per_token
    from megatron_dmoe.training.model_setup import wrap_for_training
    from megatron_dmoe.training.optim import build_optimizer
    from megatron_dmoe.training.cuda_graphs import release_layer_graphs
    from megatron_dmoe.training.step import train_step

    gbs = args.global_batch_size or args.micro_batch_size
    overrides = [
        f"model.seq_length={args.seq_length}",
        f"training.micro_batch_size={args.micro_batch_size}",
        f"training.global_batch_size={gbs}",
        f"training.bf16={'true' if args.precision == 'bf16' else 'false'}",
        f"training.device={env.device.type}",
        "training.lr_warmup_iters=0",
        f"training.cuda_graphs={'true' if cuda_graphs else 'false'}",
        *MODEL_OVERRIDES.get(name, []),
        *args.set,
    ]
    cfg = resolve(load_config(MODELS.get(name, name), overrides))
    validate(cfg, world_size=env.world_size)
    seed_everything(cfg.training.seed, env, cuda_graphs=cfg.training.cuda_graphs)
    model = wrap_for_training(build_gpt_model(cfg, vocab_size=args.vocab_size, on_cuda=env.on_cuda))
    optimizer = build_optimizer(cfg, [model], env.on_cuda)
    micro_batches = gbs // (args.micro_batch_size * env.world_size)
    per_step = cfg.moe.expert_wgrad_per_step
    data = synthetic_batches(cfg, args.vocab_size, env.device)
    sync = torch.cuda.synchronize if env.on_cuda else (lambda: None)
    if env.on_cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        train_step(model, optimizer, data, micro_batches, env.device, per_step)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss, _, _ = train_step(model, optimizer, data, micro_batches, env.device, per_step)
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    label = name + ("+graphs" if cuda_graphs else "")
    profile = profile_step(label, args.profile, lambda: train_step(model, optimizer, data, micro_batches, env.device, per_step),
                           sync) if args.profile and env.on_cuda else None
    tokens_per_s = gbs * cfg.model.seq_length / seconds
    flops = model_flops_per_token(cfg, vocab_size=padded_vocab_size(args.vocab_size, cfg))
    result = {
        "model": label,
        "cuda_graphs": cuda_graphs,
        "config": MODELS.get(name, name),
        "ms_per_step": seconds * 1e3,
        "tokens_per_s": tokens_per_s / env.world_size,
        "tflops_per_gpu": flops * tokens_per_s / env.world_size / 1e12,
        "final_loss": float(loss),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if env.on_cuda else None,
        "params": sum(p.numel() for p in model.parameters()),
        "profile": profile,
    }
    del model, optimizer
    if cuda_graphs:
        release_layer_graphs()
    gc.collect()
    if env.on_cuda:
        torch.cuda.empty_cache()
    return result


def bench_in_child(name: str, cuda_graphs: bool, argv: list) -> dict:
    """bench_model in a fresh process (its own CUDA context): this run's own arguments, then the one
    model and mode (argparse keeps the last value of an option)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        child = [sys.executable, __file__, *argv, "--models", name, "--cuda-graphs", "on" if cuda_graphs else "off",
                 "--in-process", "--no-matmul", "--out", out]
        # a one-process run of its own, even when this process was started by torchrun
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
        done = subprocess.run(child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"benchmarking {name} (cuda graphs {cuda_graphs}) failed:\n{done.stdout[-4000:]}")
        with open(out) as f:
            return json.load(f)["results"][0]


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
    (out / f"{name}_kernels.txt").write_text("\n".join(lines) + "\n")
    prof.export_chrome_trace(str(out / f"{name}_trace.json"))
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy_us / 1e3, "kernel_launches": sum(e.count for e in kernels),
            "top_kernels": [(e.key[:100], e.self_device_time_total / 1e3, e.count) for e in kernels[:15]]}


def print_table(results: list, peak: float | None) -> None:
    def dense_for(r):  # the dense run of the same mode (eager or graphed), else any dense run
        same = [d for d in results if d["model"].split("+")[0] == "dense" and d["cuda_graphs"] == r["cuda_graphs"]]
        return (same or [d for d in results if d["model"].split("+")[0] == "dense"] or [None])[0]

    header = f"{'model':16s} {'params':>8s} {'ms/step':>9s} {'tokens/s':>11s} {'TFLOP/s':>8s} {'MFU':>6s} {'vs dense':>9s} {'peak GiB':>9s}"
    print(header)
    print("-" * len(header))
    for r in results:
        mfu = f"{100 * r['tflops_per_gpu'] / peak:5.1f}%" if peak else "   n/a"
        dense = dense_for(r)
        rel = f"{r['tokens_per_s'] / dense['tokens_per_s']:8.2f}x" if dense else "      n/a"
        mem = f"{r['peak_memory_gib']:9.1f}" if r["peak_memory_gib"] is not None else "      n/a"
        print(f"{r['model']:16s} {r['params'] / 1e6:7.0f}M {r['ms_per_step']:9.1f} {r['tokens_per_s']:11,.0f} "
              f"{r['tflops_per_gpu']:8.1f} {mfu} {rel} {mem}")


def main(argv=None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed

    env = init_distributed(args.device)
    try:
        peak = None if (args.no_matmul or not env.on_cuda) else matmul_tflops(env.device)
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
        runs = [(name.strip(), graphs) for graphs in modes for name in args.models.split(",")
                if not (graphs and name.strip() in WITHOUT_GRAPHS)]
        if env.on_cuda and env.world_size == 1 and len(runs) > 1 and not args.in_process:
            results = [bench_in_child(name, graphs, argv) for name, graphs in runs]
        else:
            results = [bench_model(name, args, env, graphs) for name, graphs in runs]
    finally:
        destroy_distributed()
    if env.is_main:
        versions = {"torch": torch.__version__}
        if env.on_cuda:
            versions["gpu"] = torch.cuda.get_device_name()
        if peak:
            print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s (MFU denominator)")
        print_table(results, peak)
        for r in results:
            if r.get("profile"):
                prof = r["profile"]
                print(f"profile {r['model']}: step {prof['wall_ms']:.1f} ms wall (profiled), kernels "
                      f"{prof['gpu_busy_ms']:.1f} ms GPU ({100 * prof['gpu_busy_ms'] / prof['wall_ms']:.0f} % busy), "
                      f"{prof['kernel_launches']} launches; kernels by GPU time in {args.profile}/{r['model']}_kernels.txt")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"matmul_tflops": peak, "versions": versions, "args": vars(args), "results": results},
                          f, indent=2)


if __name__ == "__main__":
    main()
