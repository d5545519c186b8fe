"""Benchmark one whole MoE layer, forward + backward, against a dense matmul chain of the same useful FLOPs.

What one step runs (one micro-batch of T tokens, bf16 on a GPU):
  sparse        MoELayer(backend='sparse'): router, aux losses, fused permutation into the block-
                padded buffer, block-sparse expert MLP, fused weighted un-permutation; backward
                through all of it, router-weight gradient included
  grouped       MoELayer(backend='grouped'): the same router and losses, torch-op permutation
                (argsort + index_select, bmm-weighted sum) and torch.nn.functional.grouped_mm; this is
                the "torch grouped_mm with torch-op permutation" peer
  capacity-1.0  MoELayer with a capacity factor (the token-dropping baseline; torch.bmm over
  capacity-2.0  [E, capacity, d]); tokens past an expert's capacity are dropped
  sparse-fp8    sparse with training.fp8: blockwise (the experts' products in block-scaled fp8, Hopper;
                named, not by default)
  dense-equiv   gelu(X W1) W2 (SwiGLU: silu(X W1) * (X V1), one [d, 2f] matmul) on T*k rows, plain
                cuBLAS matmuls, forward + backward: the layer's cost if routing and sparsity were free

Speed is USEFUL FLOPs over time: 12*T*k*d*f (GELU) or 18*T*k*d*f (SwiGLU) for every backend, padding
and dropped tokens never counted. Time: triton.testing.do_bench, median (CPU: median of a few runs).
Activation memory: peak allocated during one forward + backward, minus what was allocated before
it (weights, input) and minus the weights' gradients (as large as the weights, allocated during
backward): what the step needs beyond its parameters.

Experts use GELU, or SwiGLU with --swiglu; a case modelled on a SwiGLU model (deepseek-v2-lite)
always uses SwiGLU (CASE_ACTIVATION).

Routing comes from a freshly initialised router on random inputs (roughly balanced). With --skew S
every case also runs with a router biased towards low expert ids, Zipf-like: logit_e += -S * log(1 + e);
the table then puts the skewed TFLOP/s of every MoE backend beside the balanced ones, with sparse's
skewed / balanced ratio and the busiest expert's load (max / mean tokens per expert) of both routings.
dense-equiv does not route, so it runs once. JSON rows carry their skew and load.
--even-routing instead routes every expert exactly T*k/E tokens (x's first E features one-hot-like,
the router reading only them): no expert needs a partly filled block, so the sparse backend computes
no padding rows. Beside the random routing it measures what the block padding costs (every row
reports `padded_rows_x`, the sparse buffer's rows at --block-size over the routed rows).
Every MoE backend of a case gets the same weights (same seed); the benchmark checks that sparse,
grouped and the capacity-2.0 layer give the same output before timing anything.

  python tools/bench_moe.py --out moe.json --png moe.png [--cases olmoe,deepseek-v2-lite] [--swiglu]
                            [--skew 2 | --even-routing] [--backends sparse,dense-equiv] [--block-size 128]
                            [--graph]    # also replay each step as a CUDA graph (no launch overhead)
                            [--profile]  # torch.profiler table of one step per backend
                            [--router torch|fused|auto]  # the MoE backends' router (auto: fused on CUDA)
  python tools/bench_moe.py --device cpu --toy      # tiny sizes; kernels under Triton's interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CASES = {  # also the cases of tools/bench_kernels.py
    # name: (T tokens, d model width, f expert width, E experts, k top-k)
    "paper-small": (16384, 768, 3072, 64, 1),
    "paper-medium": (16384, 1024, 4096, 64, 1),
    # the per-GPU part of the paper's models under expert parallelism 8: 8 local experts x 2048 rows
    "paper-small-ep8": (16384, 768, 3072, 8, 1),
    # ... and of the Small model at EP 2, micro-batch 16 (bench_train's EP 2): 32 local experts x 512 rows
    "paper-small-ep2": (16384, 768, 3072, 32, 1),
    "paper-medium-ep8": (16384, 1024, 4096, 8, 1),
    "olmoe": (16384, 2048, 1024, 64, 8),
    "mixtral": (16384, 4096, 14336, 8, 2),
    "dsv3-local": (8192, 7168, 2048, 32, 8),
    "deepseek-v2-lite": (16384, 2048, 1408, 64, 6),  # fine-grained: f = 11 blocks of 128
}
TOY_CASES = {"toy-top1": (48, 32, 64, 4, 1), "toy-top2": (40, 48, 32, 6, 2),
             "toy-fine": (64, 32, 48, 8, 4)}  # a small deepseek-v2-lite: narrow experts, SwiGLU
# Cases whose experts always use their model's activation; the others follow --swiglu.
CASE_ACTIVATION = {"deepseek-v2-lite": "swiglu", "toy-fine": "swiglu"}
BACKENDS = ["sparse", "grouped", "dense-equiv", "capacity-1.0", "capacity-2.0"]  # the default
ALL_BACKENDS = BACKENDS + ["sparse-fp8"]
AUX_LOSS_COEFF = 1e-2  # every MoE backend computes the load-balancing loss, as in training
ROUTERS = {"auto": None, "torch": False, "fused": True}  # --router: TopKRouter's `fused`


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, from {ALL_BACKENDS} (default: all but sparse-fp8)")
    p.add_argument("--swiglu", action="store_true",
                   help=f"SwiGLU experts (default GELU) for the cases without their own activation; "
                        f"always SwiGLU: {sorted(n for n, a in CASE_ACTIVATION.items() if a == 'swiglu')}")
    p.add_argument("--skew", type=float, default=0.0,
                   help="also run every case with a Zipf-like routing bias S, reported beside the balanced "
                        "run (0: the balanced run only)")
    p.add_argument("--even-routing", action="store_true",
                   help="route exactly T*k/E tokens to every expert (no partly filled blocks) instead of a "
                        "fresh router's roughly balanced routing: what the block padding costs")
    p.add_argument("--memory-optimized", action="store_true",
                   help="the MoE backends keep only the expert input and pre-activation and recompute the "
                        "activation in backward (moe.memory_optimized)")
    p.add_argument("--block-size", type=int, default=None, help="block size of the sparse backend (128; --toy: 16)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--toy", action="store_true", help="tiny cases (for a test of this program)")
    p.add_argument("--rep-ms", type=float, default=200.0, help="do_bench repetition time per measurement")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per backend")
    p.add_argument("--host-profile", action="store_true",
                   help="print a cProfile of the host side of 20 eager steps per MoE backend (what the Python "
                        "and the launches cost when the step is host-bound)")
    p.add_argument("--host-trace", action="store_true",
                   help="print torch.profiler's host-side table of 5 eager steps per backend, by self CPU time "
                        "(aten ops, autograd nodes and CUDA launch calls on every thread, backward's included)")
    p.add_argument("--graph", action="store_true",
                   help="also time steps captured once as a CUDA graph and replayed (no launch overhead)")
    p.add_argument("--graph-backends", default="sparse,dense-equiv", help="the backends --graph applies to")
    p.add_argument("--router", default="auto", choices=sorted(ROUTERS),
                   help="the MoE backends' router: torch ops (softmax, topk, sums), dmoe_kernels' fused "
                        "kernels, or auto (fused for fp32 logits on CUDA); run twice to compare launches and host ms")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--png", default=None, help="write a bar chart of TFLOP/s here")
    args = p.parse_args(argv)
    table = TOY_CASES if args.toy else CASES
    if args.block_size is None:
        args.block_size = 16 if args.toy else 128
    names = list(table) if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    for name in names:
        if name not in table:
            p.error(f"--cases: unknown case {name!r}; choose from {sorted(table)}")
    args.case_table = {n: table[n] for n in names}
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backend_list:
        if b not in ALL_BACKENDS:
            p.error(f"--backends: unknown backend {b!r}; choose from {ALL_BACKENDS}")
    if args.skew < 0:
        p.error(f"--skew: {args.skew} is negative; the bias favours low expert ids, use 0 (none) or more")
    if args.even_routing and args.skew:
        p.error("--even-routing and --skew both set the routing; use one of them")
    if args.device == "cpu" and not args.toy:
        p.error("--device cpu runs the kernels under Triton's interpreter: add --toy")
    return args


# ----------------------------------------------------------------------------------------------
# Steps: each returns (step(), parameters, inputs) where step() runs forward + backward once
# ----------------------------------------------------------------------------------------------
def moe_config(case, swiglu, dtype, device, capacity=None):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    T, d, f, E, k = case
    return TransformerConfig(
        num_layers=1, hidden_size=d, num_attention_heads=1, ffn_hidden_size=f,
        num_moe_experts=E, moe_router_topk=k, moe_ffn_hidden_size=f, moe_router_pre_softmax=True,
        moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_expert_capacity_factor=capacity,
        gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
        params_dtype=dtype, use_cpu_initialization=device.type == "cpu",
    )


def moe_step(case, backend, swiglu, skew, dtype, device, block_size, seed=0, memory_optimized=False,
             router="auto", even=False):
    import torch

    from megatron_dmoe.moe import MoELayer

    T, d, f, E, k = case
    capacity = float(backend.split("-")[1]) if backend.startswith("capacity") else None
    torch.manual_seed(seed)  # the same router and expert weights for every MoE backend of a case
    fp8 = "blockwise" if backend == "sparse-fp8" else None
    layer = MoELayer(
        moe_config(case, swiglu, dtype, device, capacity),
        backend="grouped" if capacity else "sparse" if fp8 else backend, block_size=block_size,
        memory_optimized=memory_optimized, fp8=fp8,
    ).to(device)
    layer.run_state.metrics.megatron_tracker = False  # as in dmoe-train, whose loop logs MoE metrics itself
    layer.router.fused = ROUTERS[router]
    layer.train()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(T, 1, d, generator=g, device=device, dtype=dtype)
    if skew:
        with torch.no_grad():
            x[..., 0] = 1.0  # a feature every token has, so that a router weight on it acts as a bias
            zipf = -skew * torch.log1p(torch.arange(E, device=device, dtype=torch.float32))
            layer.router.weight[:, 0] = zipf.to(dtype)
    if even:
        even_routing(layer, x, k)
    x.requires_grad_()
    dy = torch.randn(T, 1, d, generator=g, device=device, dtype=dtype)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        out, _ = layer(x)
        out.backward(dy)

    return step, params, [x], layer, x


def even_routing(layer, x, k):
    """Make the router send token t to experts (t + j) % E, j < k, with decreasing scores: exactly
    T*k/E tokens per expert when E divides T. x's first E features become those scores' one-hot-like
    codes and the router reads nothing else."""
    import torch

    T, E = x.shape[0], layer.router.weight.shape[0]
    if T % E or x.shape[-1] < E:
        raise SystemExit(f"--even-routing needs E={E} to divide T={T} and at most d={x.shape[-1]} experts")
    t = torch.arange(T, device=x.device)
    with torch.no_grad():
        x[..., :E] = 0
        for j in range(k):
            x[t, 0, (t + j) % E] = 1.0 - 0.1 * j
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = 10.0 * torch.eye(E, device=x.device, dtype=x.dtype)


def dense_step(case, swiglu, dtype, device, seed=0):
    import torch
    import torch.nn.functional as F

    T, d, f, E, k = case
    g = torch.Generator(device=device).manual_seed(seed)
    std = 0.02
    x = torch.randn(T * k, d, generator=g, device=device, dtype=dtype).requires_grad_()
    w_in = (std * torch.randn(d, 2 * f if swiglu else f, generator=g, device=device, dtype=dtype)).requires_grad_()
    w_out = (std * torch.randn(f, d, generator=g, device=device, dtype=dtype)).requires_grad_()
    dy = torch.randn(T * k, d, generator=g, device=device, dtype=dtype)

    def step():
        h = x @ w_in
        if swiglu:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h)
        (a @ w_out).backward(dy)

    return step, [w_in, w_out], [x]


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------
def clear_grads(tensors):
    for t in tensors:
        t.grad = None


def time_ms(step, grads, device, rep_ms):
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=max(25, rep_ms / 4), rep=rep_ms, grad_to_none=grads, return_mode="median"))
    times = []
    for _ in range(3):
        clear_grads(grads)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host_ms(step, grads, device):
    """Median host time to issue one step (no synchronisation inside): near the step's time means
    the step is bound by the host (launch overhead), not the GPU. (On CPU it is the step's time.)"""
    import torch

    times = []
    for _ in range(5):
        clear_grads(grads)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def kernel_launches(step, grads) -> int:
    """Kernels (and memsets) one step puts on the GPU, counted by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    clear_grads(grads)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def graph_ms(step, grads, rep_ms):
    """Median time of the step captured as one CUDA graph and replayed."""
    import torch
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            clear_grads(grads)
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear_grads(grads)  # gradients are then allocated inside the graph and rewritten by each replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    try:
        return float(do_bench(graph.replay, warmup=max(25, rep_ms / 4), rep=rep_ms, return_mode="median"))
    finally:
        del graph
        clear_grads(grads)


def profile_host(fn, calls: int = 200, top: int = 18, before=None) -> str:
    """cProfile of many calls of fn, host side only (the GPU work runs asynchronously), sorted by
    own time; before() runs ahead of each call, unprofiled (clearing gradients, say)."""
    import cProfile
    import io
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(calls):
        if before is not None:
            before()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def profile_table(step, grads, rows=25):
    import torch
    from torch.profiler import ProfilerActivity, profile

    clear_grads(grads)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def host_trace(step, grads, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler's host side of `steps` eager steps, sorted by self CPU time: where issuing a
    step goes, on the autograd worker thread too (which cProfile does not see), with the wall time
    per step under the profiler for scale."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    clear_grads(grads)
    step()
    torch.cuda.synchronize()
    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            clear_grads(grads)
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            wall += time.perf_counter() - start
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=55)
    return f"host trace: {wall / steps * 1e3:.3f} ms wall per step under the profiler ({steps} steps)\n{table}"


def activation_memory(step, params, inputs, device):
    """Bytes the step allocates at its peak beyond parameters, input and the weights' gradients."""
    import torch

    if device.type != "cuda":
        return None
    clear_grads(params + inputs)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    weight_grads = sum(p.numel() * p.element_size() for p in params)
    return int(peak - before - weight_grads)


def routing_stats(layer, x, block_size):
    """Loads per expert of this routing, and the sparse buffer's rows (each expert padded to whole
    blocks) over the routed rows (host copies: measured outside the timed steps)."""
    import torch

    with torch.no_grad():
        routing = layer.router(x.detach().reshape(-1, x.shape[-1]))
    load = routing.tokens_per_expert.long()
    padded = int(((load + block_size - 1) // block_size * block_size).sum())
    return {"load_max_over_mean": float(load.double().max() / load.double().mean()),
            "experts_without_tokens": int((load == 0).sum()), "padded_rows_x": padded / max(int(load.sum()), 1)}


def router_path(layer, x):
    """'fused' or 'torch': the router path the layer's logits (fp32 for 16-bit inputs) take."""
    import torch

    logits_dtype = torch.promote_types(x.dtype, torch.float32)
    probe = torch.empty(0, layer.options.num_experts, dtype=logits_dtype, device=x.device)
    return "fused" if layer.router.uses_fused(probe) else "torch"


def case_activation(name, swiglu):
    """The experts' activation in case `name`: its own, else SwiGLU when --swiglu, else GELU."""
    return CASE_ACTIVATION.get(name, "swiglu" if swiglu else "gelu")


def useful_flops(case, swiglu):
    T, d, f, E, k = case
    return (18 if swiglu else 12) * T * k * d * f


def run_case(name, case, args, device, dtype, report):
    """Rows of every backend on balanced routing, then (--skew S) of the MoE backends on skewed routing."""
    rows = []
    for skew in (0.0, args.skew) if args.skew else (0.0,):
        backends = [b for b in args.backend_list if not (skew and b == "dense-equiv")]  # dense does not route
        if skew:
            report(f"  skew {skew:g}:")
        rows += run_routing(name, case, args, backends, skew, device, dtype, report)
    dense = next((r for r in rows if r["backend"] == "dense-equiv"), None)
    balanced = {r["backend"]: r for r in rows if r["skew"] == 0}
    for r in rows:
        if dense is not None:
            r["x_dense"] = r["tflops"] / dense["tflops"]
            if r["act_mem_bytes"] is not None and dense["act_mem_bytes"]:
                r["mem_x_dense"] = r["act_mem_bytes"] / dense["act_mem_bytes"]
        if r["skew"]:
            r["x_balanced"] = r["tflops"] / balanced[r["backend"]]["tflops"]
    return rows


def run_routing(name, case, args, backends, skew, device, dtype, report):
    import torch

    swiglu = case_activation(name, args.swiglu) == "swiglu"
    flops = useful_flops(case, swiglu)
    outputs = {}
    rows = []
    for backend in backends:
        if backend == "dense-equiv":
            step, params, inputs = dense_step(case, swiglu, dtype, device)
            extra = {}
        else:
            step, params, inputs, layer, x = moe_step(case, backend, swiglu, skew, dtype, device,
                                                     args.block_size, memory_optimized=args.memory_optimized,
                                                     router=args.router, even=args.even_routing)
            extra = routing_stats(layer, x, args.block_size)
            extra["router"] = router_path(layer, x)
            with torch.no_grad():
                outputs[backend] = layer(x)[0].float()
            if backend.startswith("capacity"):
                extra["capacity_factor"] = float(backend.split("-")[1])
            else:
                extra["expert_backend"] = layer.experts.backend_for(x).name
        step()  # compile and warm up
        mem = activation_memory(step, params, inputs, device)
        ms = time_ms(step, params + inputs, device, args.rep_ms)
        row = dict(case=name, backend=backend, activation="swiglu" if swiglu else "gelu", skew=skew, ms=ms,
                   tflops=flops / (ms * 1e-3) / 1e12, act_mem_bytes=mem,
                   host_ms=host_ms(step, params + inputs, device) if device.type == "cuda" else ms, **extra)
        if device.type == "cuda":
            row["launches"] = kernel_launches(step, params + inputs)
        rows.append(row)
        report(f"  {backend:<13} {ms:9.3f} ms {_fmt(row['tflops']):>7} TFLOP/s"
               + (f"  act mem {mem / 2**30:7.3f} GiB" if mem is not None else "")
               + f"  host {row['host_ms']:.2f} ms"
               + (f"  load max/mean {extra['load_max_over_mean']:.2f}  padded rows x{extra['padded_rows_x']:.3f}"
                  if "load_max_over_mean" in extra else ""))
        if args.profile and device.type == "cuda":
            report(profile_table(step, params + inputs))
        if args.host_trace and device.type == "cuda":
            report(host_trace(step, params + inputs))
        if args.host_profile and device.type == "cuda" and backend != "dense-equiv":
            report(profile_host(step, calls=20, top=30, before=lambda: clear_grads(params + inputs)))
        if args.graph and device.type == "cuda" and backend in args.graph_backends.split(","):
            try:
                row["graph_ms"] = graph_ms(step, params + inputs, args.rep_ms)
                row["graph_tflops"] = flops / (row["graph_ms"] * 1e-3) / 1e12
                report(f"  {'':<13} {row['graph_ms']:9.3f} ms {_fmt(row['graph_tflops']):>7} TFLOP/s  as a CUDA graph")
            except Exception as exc:  # a backend that cannot be captured: say so, measure the rest
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                report(f"  {'':<13} not capturable as a CUDA graph: {row['graph_error']}")
        step = params = inputs = None  # free them: the lambdas above hold these names
        if backend != "dense-equiv":
            del layer, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    check_agreement(outputs, dtype, report)
    return rows


def check_agreement(outputs, dtype, report):
    """Dropless backends (and capacity 2.0 when it drops nothing) must agree on the layer's output."""
    import torch

    ref = outputs.get("grouped")
    tol = 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    # fp8 e4m3 rounds each operand to 3 mantissa bits: a few percent, up to 2^-4 of an element's tile
    tols = {"sparse": tol, "sparse-fp8": 0.15}
    for name in ("sparse", "sparse-fp8", "capacity-2.0"):
        if ref is None or name not in outputs:
            continue
        err = float((outputs[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if name in tols and err > tols[name]:
            raise SystemExit(f"{name} output differs from grouped by {err:.3g} (> {tols[name]}): not timing a wrong "
                             "layer")
        report(f"  check: {name} vs grouped output, max rel diff {err:.2e}")


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------
def _fmt(tflops: float) -> str:
    return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.3g}"


def _load(row):
    return f"{row['load_max_over_mean']:.2f}" if row and "load_max_over_mean" in row else "-"


def summary_table(rows, backends):
    """Markdown: one row per case, TFLOP/s per backend, sparse against dense-equiv and grouped; with
    skewed rows, the skewed TFLOP/s of the MoE backends, sparse skewed / balanced and the busiest
    expert's load (max / mean) of both routings."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    get = {(r["case"], r["backend"]): r for r in rows if not r.get("skew")}
    skewed = {(r["case"], r["backend"]): r for r in rows if r.get("skew")}
    skew = next((r["skew"] for r in skewed.values()), None)
    skew_backends = [b for b in backends if any((c, b) in skewed for c in cases)]
    head = ["case"] + [f"{b} TFLOP/s" for b in backends]
    if "sparse" in backends and "dense-equiv" in backends:
        head += ["sparse / dense", "sparse mem / dense mem", "sparse padded rows / routed"]
    if "sparse" in backends and "grouped" in backends:
        head += ["sparse / grouped"]
    if "sparse" in backends and "sparse-fp8" in backends:
        head += ["fp8 / bf16 sparse"]
    if skewed:
        head += [f"{b} skew {skew:g} TFLOP/s" for b in skew_backends]
        if "sparse" in skew_backends:
            head += ["sparse skewed / balanced"]
        head += ["load max/mean balanced", f"load max/mean skew {skew:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        cells = [c] + [_fmt(get[(c, b)]["tflops"]) if (c, b) in get else "-" for b in backends]
        s, dn, gr = get.get((c, "sparse")), get.get((c, "dense-equiv")), get.get((c, "grouped"))
        if "sparse" in backends and "dense-equiv" in backends:
            cells.append(f"{s['tflops'] / dn['tflops']:.2f}" if s and dn else "-")
            cells.append(f"{s['mem_x_dense']:.2f}" if s and s.get("mem_x_dense") else "-")
            cells.append(f"{s['padded_rows_x']:.3f}" if s and "padded_rows_x" in s else "-")
        if "sparse" in backends and "grouped" in backends:
            cells.append(f"{s['tflops'] / gr['tflops']:.2f}" if s and gr else "-")
        if "sparse" in backends and "sparse-fp8" in backends:
            s8 = get.get((c, "sparse-fp8"))
            cells.append(f"{s8['tflops'] / s['tflops']:.2f}" if s and s8 else "-")
        if skewed:
            cells += [_fmt(skewed[(c, b)]["tflops"]) if (c, b) in skewed else "-" for b in skew_backends]
            if "sparse" in skew_backends:
                ss = skewed.get((c, "sparse"))
                cells.append(f"{ss['x_balanced']:.2f}" if ss and "x_balanced" in ss else "-")
            # every MoE backend of a case has the same router: the first one's load stands for all
            moe = [b for b in skew_backends if (c, b) in skewed]
            cells += [_load(get.get((c, moe[0])) if moe else None), _load(skewed.get((c, moe[0])) if moe else None)]
        lines.append("| " + " | ".join(cells) + " |")
    if any("launches" in r for r in get.values()):
        # the host's side of one forward + backward: time to issue it and kernels issued
        head = ["case (host, eager)"] + [f"{b} host ms / launches" for b in backends]
        if "sparse" in backends and "dense-equiv" in backends:
            head.append("sparse host / dense host")
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cases:
            cells = [c] + [f"{get[(c, b)]['host_ms']:.2f} / {get[(c, b)].get('launches', '-')}" if (c, b) in get
                           else "-" for b in backends]
            if "sparse" in backends and "dense-equiv" in backends:
                s, dn = get.get((c, "sparse")), get.get((c, "dense-equiv"))
                cells.append(f"{s['host_ms'] / dn['host_ms']:.2f}" if s and dn else "-")
            lines.append("| " + " | ".join(cells) + " |")
    graphed = [r for r in rows if "graph_tflops" in r and not r.get("skew")]
    if graphed:
        gget = {(r["case"], r["backend"]): r["graph_tflops"] for r in graphed}
        gb = [b for b in backends if any((c, b) in gget for c in cases)]
        head = ["case (CUDA graph replay)"] + [f"{b} TFLOP/s" for b in gb]
        if "sparse" in gb and "dense-equiv" in gb:
            head.append("sparse / dense")
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cases:
            cells = [c] + [_fmt(gget[(c, b)]) if (c, b) in gget else "-" for b in gb]
            if "sparse" in gb and "dense-equiv" in gb:
                s, dn = gget.get((c, "sparse")), gget.get((c, "dense-equiv"))
                cells.append(f"{s / dn:.2f}" if s and dn else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(rows, backends, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    get = {(r["case"], r["backend"]): r["tflops"] for r in rows if not r.get("skew")}  # balanced routing
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cases)), 4))
    for i, b in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, [get.get((c, b), 0.0) for c in cases], width, label=b)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases)
    ax.set_ylabel("useful TFLOP/s (fwd + bwd)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu --toy")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def report(msg):
        print(msg, flush=True)

    act = "swiglu" if args.swiglu else "gelu"  # of the cases without their own
    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, dtype=str(dtype).replace("torch.", ""), activation=act, skew=args.skew,
        memory_optimized=args.memory_optimized, router=args.router, even_routing=args.even_routing,
        block_size=args.block_size, aux_loss_coeff=AUX_LOSS_COEFF, date=time.strftime("%Y-%m-%d %H:%M"),
        timing="triton.testing.do_bench median" if device.type == "cuda" else "median of 3 wall-clock runs",
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = []
    for name, case in args.case_table.items():
        T, d, f, E, k = case
        report(f"{name}: T={T} d={d} f={f} E={E} k={k} {case_activation(name, args.swiglu)}"
               + (f", balanced and skew {args.skew:g}" if args.skew else ""))
        case_rows = run_case(name, case, args, device, dtype, report)
        rows.extend(case_rows)
    table = summary_table(rows, args.backend_list)
    report("\n" + table)
    result = {"meta": meta, "cases": {n: dict(zip("T d f E k".split(), c), activation=case_activation(n, args.swiglu))
                                      for n, c in args.case_table.items()},
              "results": rows, "table": table}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.png:
        acts = sorted({case_activation(n, args.swiglu) for n in args.case_table})
        bar_chart(rows, args.backend_list, args.png, f"MoE layer fwd+bwd, {meta['device']}, {'/'.join(acts)}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
