#!/usr/bin/env python
"""Expert-parallel benchmark: token exchange against a raw all-to-all, and the MoE layer at EP sizes.

For every expert-parallel size EP in --ep that divides the number of processes, and every expert
exchange in --exchange (nccl: variable-split all_to_all; symmetric: rows stored into peer GPUs'
memory, see megatron_dmoe/moe/exchange/symmetric.py):
  * dispatch + combine (ExpertParallelDispatcher, identity experts in between; router weights that
    need a gradient, as in training) at each message size of --exchange-mib (MiB each rank sends
    per exchange): time per call against two raw all_to_all_single calls moving the same bytes in
    equal splits. Bandwidth is bus bandwidth (nccl-tests' convention for all-to-all): bytes sent
    per rank / time * (EP-1)/EP, and the ratio of the two is the exchange's efficiency;
  * the MoE layer's forward + backward at a fixed number of tokens per process (--tokens), with
    the experts spread over EP ranks (EP = 1: every process runs all experts, data parallel).
Routing is uniform random (balanced on average). Calls run back to back (the dispatch's own
host synchronisation for the split sizes included); each time is the mean over --iters calls
after --warmup calls, of the slowest rank. Rank 0 prints two tables and writes JSON (--out).

  torchrun --standalone --nproc_per_node 4 tools/bench_ep.py --out ep.json
  torchrun --standalone --nproc_per_node 2 tools/bench_ep.py --device cpu --tokens 256 \\
      --hidden 64 --ffn 128 --experts 4 --exchange-mib 0.25 --out ep_cpu.json   # gloo smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

# NVLink SHARP / multicast off for NCCL and torch's symmetric memory: on machines where the
# fabric manager does not provide multicast these paths fail or hang. Set unless already set.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

EXCHANGE_COLUMNS = [
    ("ep", "EP", "{:d}"),
    ("exchange", "exchange", "{}"),
    ("push_programs", "push programs", "{}"),
    ("exchange_mib_per_rank", "MiB/rank", "{:g}"),
    ("dispatch_combine_ms", "disp+comb ms", "{:.3f}"),
    ("dispatch_busbw_gbs", "busbw GB/s", "{:.1f}"),
    ("raw_all_to_all_ms", "raw 2x a2a ms", "{:.3f}"),
    ("raw_busbw_gbs", "raw busbw GB/s", "{:.1f}"),
    ("efficiency", "disp/raw", "{:.1%}"),
    ("graph_ms", "as a CUDA graph ms", "{:.3f}"),
    ("graph_efficiency", "graph/raw", "{:.1%}"),
]
LAYER_COLUMNS = [
    ("ep", "EP", "{:d}"),
    ("exchange", "exchange", "{}"),
    ("push_programs", "push programs", "{}"),
    ("local_experts", "local experts", "{:d}"),
    ("layer_fwd_bwd_ms", "layer fwd+bwd ms", "{:.3f}"),
    ("layer_graph_ms", "as a CUDA graph ms", "{:.3f}"),
    ("layer_tokens_per_s", "tokens/s (all)", "{:.0f}"),
]
# with --shared-ffn: how much of the shared MLP's time the layer hides (behind the exchange)
SHARED_COLUMNS = [
    ("ep", "EP", "{:d}"),
    ("exchange", "exchange", "{}"),
    ("layer_fwd_bwd_ms", "layer ms", "{:.3f}"),
    ("layer_without_shared_ms", "without shared ms", "{:.3f}"),
    ("shared_alone_ms", "shared MLP alone ms", "{:.3f}"),
    ("shared_hidden", "shared time hidden", "{:.0%}"),
    ("graph_layer_ms", "graph: layer ms", "{:.3f}"),
    ("graph_without_shared_ms", "without shared ms", "{:.3f}"),
    ("graph_shared_alone_ms", "shared alone ms", "{:.3f}"),
    ("graph_shared_hidden", "hidden", "{:.0%}"),
]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    env_text = " ".join(f"{k}={v}" for k, v in NCCL_ENV.items())
    parser = argparse.ArgumentParser(
        description="Time expert-parallel dispatch+combine against a raw all_to_all_single of the same "
                    "bytes, and the dMoE layer's forward+backward at several expert-parallel sizes. "
                    "Run it under torchrun (one process per GPU).",
        epilog=f"NCCL environment: this tool sets {env_text} unless they are set already (NVLink "
               f"multicast off); set them the same way for training runs. Example: torchrun "
               f"--standalone --nproc_per_node 4 tools/bench_ep.py --out ep.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda (NCCL) or cpu (gloo); auto picks cuda when available")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per process (default 8192)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--exchange-mib", default="16,64,256",
                        help="message sizes of the dispatch+combine measurement: MiB each rank sends per "
                             "exchange, comma-separated (default 16,64,256)")
    parser.add_argument("--exchange", default="auto",
                        help="expert exchanges to measure, comma-separated: nccl, symmetric (auto: both on "
                             "cuda, nccl on cpu)")
    parser.add_argument("--ffn", type=int, default=4096, help="expert ffn size (default 4096)")
    parser.add_argument("--experts", type=int, default=64, help="number of experts (default 64)")
    parser.add_argument("--top-k", type=int, default=1, help="experts per token (default 1)")
    parser.add_argument("--ep", default="1,2,4", help="expert-parallel sizes, comma-separated (default 1,2,4); "
                                                    "sizes that do not divide the process count are skipped")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--backend", default="auto", help="expert backend of the layer (default auto)")
    parser.add_argument("--shared-ffn", type=int, default=0, metavar="N",
                        help="give the layer a shared expert of width N (default 0: none) and also time the "
                             "layer without it and the shared MLP alone: the share of the shared MLP's time "
                             "the layer hides, (without + alone - with) / alone, e.g. behind the exchange")
    parser.add_argument("--push-programs", default="auto", metavar="N[,N...]",
                        help="programs of the symmetric exchange's push kernels, comma-separated: auto (two "
                             "per multiprocessor) and/or numbers; each symmetric row is measured per value "
                             "(fewer programs leave multiprocessors to a shared expert on its side stream)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also profile --iters dispatch+combine calls per size, and layer steps, on rank 0 "
                             "(torch.profiler): "
                             "per call the wall time, the host's wait for the split sizes and the GPU's "
                             "kernel time, and DIR/exchange_ep<EP>_<MiB>MiB.txt with the CPU ops and kernels")
    parser.add_argument("--out", type=Path, help="JSON file for the results (written by rank 0)")
    args = parser.parse_args(argv)
    try:
        args.ep = sorted({int(x) for x in args.ep.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--ep {args.ep!r}: give comma-separated integers such as 1,2,4")
    for name in ("tokens", "hidden", "ffn", "experts", "top_k", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.shared_ffn < 0:
        parser.error(f"--shared-ffn must be >= 0 (0: no shared expert), got {args.shared_ffn}")
    try:
        args.exchange_mib = [float(x) for x in args.exchange_mib.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--exchange-mib {args.exchange_mib!r}: give comma-separated numbers such as 64,256")
    args.exchange = [x.strip() for x in args.exchange.split(",") if x.strip()]
    try:
        args.push_programs = [None if x.strip() == "auto" else int(x) for x in args.push_programs.split(",")
                              if x.strip()]
    except ValueError:
        parser.error(f"--push-programs {args.push_programs!r}: give auto and/or numbers, e.g. auto,32")
    if not args.push_programs or any(n is not None and n < 1 for n in args.push_programs):
        parser.error("--push-programs needs auto or numbers >= 1")
    if not set(args.exchange) <= {"auto", "nccl", "symmetric"} or ("auto" in args.exchange and len(args.exchange) > 1):
        parser.error(f"--exchange {','.join(args.exchange)}: give auto, or nccl and/or symmetric")
    if not args.exchange_mib or min(args.exchange_mib) <= 0:
        parser.error("--exchange-mib needs sizes > 0")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if not args.ep or min(args.ep) < 1:
        parser.error("--ep needs sizes >= 1")
    return args


def format_table(rows: List[dict], columns=EXCHANGE_COLUMNS) -> str:
    """Fixed-width table of the result rows; '-' where a value is missing."""
    header = [title for _, title, _ in columns]
    lines = [[fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def write_json(path: Path, results: dict) -> None:
    """The results as JSON at path (its folder made), and a line saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


def _timed(fn, args, device) -> float:
    """Mean seconds per call of fn() run back to back on this rank, then the largest over all ranks."""
    import torch
    import torch.distributed as dist

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        fn()
    sync()
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    sync()
    seconds = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _graph_timed(fn, args, device) -> float:
    """Seconds per replay of fn captured as one CUDA graph (after _timed has warmed it up), the largest
    over all ranks: the call without the host's share."""
    import torch

    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return _timed(graph.replay, args, device)
    finally:
        del graph


def _profile(fn, args, device, name: str) -> Optional[dict]:
    """Profile --iters calls of fn on every rank, report rank 0's: where a call's time goes."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    if dist.get_rank() != 0:
        return None
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    waits = sum(e.self_cpu_time_total for e in events if e.key in ("cudaEventSynchronize", "cudaStreamSynchronize",
                                                                      "cudaDeviceSynchronize"))
    args.profile.mkdir(parents=True, exist_ok=True)
    table = events.table(sort_by="self_cpu_time_total", row_limit=30)
    if kernels:
        table += "\n" + events.table(sort_by="self_device_time_total", row_limit=20)
    (args.profile / f"{name}.txt").write_text(table + "\n")
    n = args.iters
    return {"wall_ms_per_call": 1e3 * wall / n, "host_wait_ms_per_call": waits / 1e3 / n,
            "gpu_kernel_ms_per_call": sum(e.self_device_time_total for e in kernels) / 1e3 / n,
            "launches_per_call": sum(e.count for e in kernels) / n}


def _random_routing(args, tokens, device, dtype, generator):
    import torch

    scores = torch.rand(tokens, args.experts, device=device, generator=generator)
    weights, indices = torch.topk(scores, args.top_k, dim=-1)
    return indices, weights.to(dtype)


def bench_exchange(args, ep: int, exchange: str, device, dtype, mib: float, programs=None) -> dict:
    """Dispatch + combine with identity experts, and two raw all-to-alls of the same bytes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dmoe.moe.exchange.dispatcher import ExpertParallelDispatcher
    from megatron_dmoe.parallel.expert_layout import ExpertLayout

    group = ps.get_expert_model_parallel_group()
    layout = ExpertLayout(args.experts, args.ffn, ep, ps.get_expert_model_parallel_rank())
    # as with the sparse experts: the combine reads the received rows next
    dispatcher = ExpertParallelDispatcher(layout, group, exchange, rows_consumed_at_once=True)
    if exchange == "symmetric":
        from megatron_dmoe.moe.exchange.symmetric import SymmetricExchanges

        dispatcher.exchanges = SymmetricExchanges()
        dispatcher.exchanges.set_push_programs(programs)
    element = torch.empty((), dtype=dtype).element_size()
    copies = args.top_k * layout.shards_per_expert  # rows each token sends
    tokens = max(1, round(mib * 2**20 / (args.hidden * element * copies)))
    generator = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(tokens, args.hidden, device=device, dtype=dtype, generator=generator)
    indices, weights = _random_routing(args, tokens, device, dtype, generator)
    weights.requires_grad_()  # the combine keeps what the weights' gradient needs, as in training

    def dispatch_combine():
        x_local, _, state = dispatcher.dispatch(x, indices, weights)
        return dispatcher.combine(x_local, state)

    seconds = _timed(dispatch_combine, args, device)
    # nothing read on the host: the symmetric exchange captures as a graph
    graph_seconds = _graph_timed(dispatch_combine, args, device) if exchange == "symmetric" and device.type == "cuda" \
        else None
    profile = (_profile(dispatch_combine, args, device, f"exchange_ep{ep}_{exchange}_{mib:g}MiB")
               if args.profile else None)
    rows = tokens * copies  # every assignment leaves once, comes back once
    exchanged = 2 * rows * args.hidden * element

    # the same bytes as one flat buffer in equal splits, out and back
    count = -(-rows * args.hidden // ep) * ep
    send = torch.randn(count, device=device, dtype=dtype, generator=generator)
    recv = torch.empty_like(send)

    def raw_pair():
        dist.all_to_all_single(recv, send, group=group)
        dist.all_to_all_single(send, recv, group=group)

    raw_seconds = _timed(raw_pair, args, device)
    raw_bytes = 2 * count * element
    factor = (ep - 1) / ep
    busbw, raw_busbw = exchanged / seconds * factor / 1e9, raw_bytes / raw_seconds * factor / 1e9
    return {
        "ep": ep,
        "exchange": exchange,
        "push_programs": _programs_text(exchange, programs),
        "exchange_mib_per_rank": exchanged / 2 / 2**20,
        "tokens_per_rank": tokens,
        "dispatch_combine_ms": 1e3 * seconds,
        "exchange_bytes_per_rank": exchanged,
        "dispatch_busbw_gbs": busbw,
        "raw_all_to_all_ms": 1e3 * raw_seconds,
        "raw_bytes_per_rank": raw_bytes,
        "raw_busbw_gbs": raw_busbw,
        "efficiency": busbw / raw_busbw,
        "graph_ms": None if graph_seconds is None else 1e3 * graph_seconds,
        "graph_efficiency": None if graph_seconds is None else raw_seconds / graph_seconds,
        "profile": profile,
    }


def _programs_text(exchange: str, programs) -> str:
    return "-" if exchange != "symmetric" else ("auto" if programs is None else str(programs))


def bench_layer(args, ep: int, exchange: str, device, dtype, programs=None) -> dict:
    """Forward + backward of one MoE layer on --tokens tokens per process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dmoe.moe import MoELayer

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1, num_moe_experts=args.experts,
        moe_router_topk=args.top_k, moe_ffn_hidden_size=args.ffn, moe_router_pre_softmax=True,
        activation_func=F.gelu, params_dtype=dtype, use_cpu_initialization=device.type == "cpu",
        expert_model_parallel_size=ep,
    )

    def make_layer(shared_ffn: int, run_state=None):
        return MoELayer(config, backend=args.backend, ep_exchange=exchange, run_state=run_state,
                        shared_expert_ffn_hidden_size=shared_ffn).to(device).train()

    layer = make_layer(args.shared_ffn)
    layer.run_state.exchanges.set_push_programs(programs)
    generator = torch.Generator(device=device).manual_seed(2000 + dist.get_rank())
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, generator=generator).requires_grad_()
    out_grad = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, generator=generator)

    def layer_step(moe):
        def step():
            out, _ = moe(x)
            out.backward(out_grad)
            moe.run_state.metrics.reset()
        return step

    step = layer_step(layer)
    seconds = _timed(step, args, device)
    graphable = device.type == "cuda" and (ep == 1 or exchange == "symmetric")  # nothing read on the host
    shared = {}
    if args.shared_ffn:
        # the same run state: the second layer reuses the first one's exchange buffers
        without_step = layer_step(make_layer(0, layer.run_state))
        without = _timed(without_step, args, device)

        def shared_step():
            layer.shared_experts(x.view(-1, args.hidden)).backward(out_grad.view(-1, args.hidden))

        alone = _timed(shared_step, args, device)
        shared = {"layer_without_shared_ms": 1e3 * without, "shared_alone_ms": 1e3 * alone,
                  "shared_hidden": (without + alone - seconds) / alone}
        if graphable:  # eagerly the host's launches dominate; as graphs the GPU's overlap shows
            with_g, without_g, alone_g = (_graph_timed(fn, args, device) for fn in (step, without_step, shared_step))
            shared.update(graph_layer_ms=1e3 * with_g, graph_without_shared_ms=1e3 * without_g,
                          graph_shared_alone_ms=1e3 * alone_g,
                          graph_shared_hidden=(without_g + alone_g - with_g) / alone_g)
    profile = _profile(step, args, device, f"layer_ep{ep}_{exchange if ep > 1 else 'local'}") if args.profile else None
    graph_ms = None
    if graphable:
        graph_ms = shared["graph_layer_ms"] if "graph_layer_ms" in shared else 1e3 * _graph_timed(step, args, device)
    return {
        "ep": ep,
        "exchange": exchange if ep > 1 else "-",
        "push_programs": _programs_text(exchange if ep > 1 else "-", programs),
        "layer_fwd_bwd_ms": 1e3 * seconds,
        "layer_graph_ms": graph_ms,
        "profile": profile,
        "layer_tokens_per_s": args.tokens * dist.get_world_size() / seconds,
        "local_experts": layer.experts.layout.num_local_experts,
        "local_ffn": layer.experts.layout.local_ffn_hidden_size,
        "shared_ffn": args.shared_ffn,
        **shared,
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    import torch

    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything

    env = init_distributed(args.device)
    device = env.device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if env.on_cuda else torch.float32)
    world = env.world_size
    exchanges = args.exchange if args.exchange != ["auto"] else (["nccl", "symmetric"] if env.on_cuda else ["nccl"])
    results = {
        "world_size": world, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_rank": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts,
        "top_k": args.top_k, "iters": args.iters, "warmup": args.warmup, "shared_ffn": args.shared_ffn,
        "nccl_env": {k: os.environ.get(k) for k in NCCL_ENV} if env.on_cuda else None,
        "exchange_mib": args.exchange_mib, "exchange": [], "layer": [], "skipped_ep": [],
    }
    if env.on_cuda:
        results["gpu"] = torch.cuda.get_device_name(device)
        results["versions"] = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    try:
        for ep in args.ep:
            if world % ep or (args.experts % ep and ep % args.experts):
                results["skipped_ep"].append(ep)
                continue
            init_distributed(args.device, expert_model_parallel_size=ep)  # rebuilds megatron's groups
            seed_everything(1234, env)
            for exchange in exchanges if ep > 1 else exchanges[:1]:
                for programs in args.push_programs if ep > 1 and exchange == "symmetric" else [None]:
                    if ep > 1:
                        results["exchange"] += [bench_exchange(args, ep, exchange, device, dtype, mib, programs)
                                                for mib in args.exchange_mib]
                    results["layer"].append(bench_layer(args, ep, exchange, device, dtype, programs))
        if env.is_main:
            where = f"one {results['gpu']} each" if env.on_cuda else "CPU, gloo"
            print(f"{world} processes ({where}), {results['dtype']}, {args.experts} experts, top-{args.top_k}, "
                  f"hidden {args.hidden}")
            if results["exchange"]:
                print("\ndispatch + combine (identity experts) vs two raw all_to_all_single of the same bytes")
                print(format_table(results["exchange"], EXCHANGE_COLUMNS))
                for row in results["exchange"]:
                    prof = row.get("profile")
                    if prof:
                        print(f"profile EP {row['ep']} {row['exchange']} {row['exchange_mib_per_rank']:g} MiB "
                              f"(rank 0, per call): {prof['wall_ms_per_call']:.3f} ms wall, "
                              f"host waits {prof['host_wait_ms_per_call']:.3f} ms "
                              f"for the split sizes/sync, kernels {prof['gpu_kernel_ms_per_call']:.3f} ms GPU, "
                              f"{prof['launches_per_call']:.0f} launches")
            shared_text = f", shared expert {args.shared_ffn}" if args.shared_ffn else ""
            print(f"\nMoE layer forward + backward, {args.tokens} tokens/process, ffn {args.ffn}{shared_text}")
            print(format_table(results["layer"], LAYER_COLUMNS))
            if args.shared_ffn:
                print("\nshared expert: the layer's time with it, without it, the shared MLP alone (eager)")
                print(format_table(results["layer"], SHARED_COLUMNS))
            if results["skipped_ep"]:
                print(f"skipped EP sizes {results['skipped_ep']}: they must divide the {world} processes and "
                      f"divide or be a multiple of {args.experts} experts")
            if args.out:
                write_json(args.out, results)
    finally:
        destroy_distributed()
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
