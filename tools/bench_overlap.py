#!/usr/bin/env python
"""Can the expert-parallel exchange hide under the experts' products? The measurement a chunked
MoE layer (one chunk's exchange running under another chunk's experts) depends on.

For each expert-parallel size in --ep and push-program count in --push-programs, on the symmetric
exchange, each part captured as a CUDA graph (eagerly the host's launches would decide) and timed
on every rank, the slowest rank's time kept:

  experts    the sparse experts' forward products (up-projection with GELU, down-projection, the
             permutation around them) on one chunk of received rows: --tokens tokens per rank
             routed top --top-k over --experts uniformly at random (balanced on average)
  exchange   dispatch + combine of another chunk of the same size (identity experts between)
  both       the two at once, the exchange on a second stream
  hidden     (experts on every multiprocessor + exchange - both) / exchange: the share of the
             exchange's time that running it beside the products saves, net of what leaving
             multiprocessors free costs the products

The experts' products are persistent kernels sized to fill every multiprocessor; the exchange's
push kernels then wait for multiprocessors unless --push-programs gives them fewer programs or
--free-sms has the products leave some multiprocessors free (`leave_multiprocessors_free`): each
row is one (push programs, free multiprocessors) pair. Rank 0 prints a table and writes JSON (--out).

  torchrun --standalone --nproc_per_node 2 tools/bench_overlap.py --out overlap.json
  torchrun --standalone --nproc_per_node 4 tools/bench_overlap.py --ep 2,4 --push-programs auto,16,32 --free-sms 0,8,16

Defaults: the Small model at expert parallelism 2, a chunk of half a micro-batch of 16 x 1024 tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ep import NCCL_ENV, _graph_timed, _random_routing, format_table, write_json  # noqa: E402

COLUMNS = [
    ("ep", "EP", "{:d}"),
    ("push_programs", "push programs", "{}"),
    ("free_sms", "free SMs", "{:d}"),
    ("local_experts", "local experts", "{:d}"),
    ("experts_ms", "experts ms", "{:.3f}"),
    ("exchange_ms", "exchange ms", "{:.3f}"),
    ("both_ms", "both ms", "{:.3f}"),
    ("hidden", "exchange hidden", "{:.0%}"),
]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", default="2", help="expert-parallel sizes, comma-separated (default 2); each must "
                                                  "divide the process count and be at least 2")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank in each chunk (default 8192)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--ffn", type=int, default=3072, help="expert ffn size (default 3072)")
    parser.add_argument("--experts", type=int, default=64, help="number of experts (default 64)")
    parser.add_argument("--top-k", type=int, default=1, help="experts per token (default 1)")
    parser.add_argument("--push-programs", default="auto,16,32", metavar="N[,N...]",
                        help="programs of the exchange's push kernels, comma-separated: auto (two per "
                             "multiprocessor) and/or numbers (default auto,16,32)")
    parser.add_argument("--free-sms", default="0,16", metavar="N[,N...]",
                        help="multiprocessors the experts' persistent products leave free for the exchange, "
                             "comma-separated (default 0,16)")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed replays first (default 5)")
    parser.add_argument("--out", type=Path, help="JSON file for the results (written by rank 0)")
    args = parser.parse_args(argv)
    try:
        args.ep = sorted({int(x) for x in args.ep.split(",") if x.strip()})
        args.push_programs = [None if x.strip() == "auto" else int(x) for x in args.push_programs.split(",")
                              if x.strip()]
        args.free_sms = sorted({int(x) for x in args.free_sms.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--ep {args.ep!r} / --push-programs {args.push_programs!r} / --free-sms {args.free_sms!r}: "
                     "give comma-separated integers (and auto for --push-programs), e.g. --ep 2,4 "
                     "--push-programs auto,16 --free-sms 0,16")
    if not args.ep or min(args.ep) < 2:
        parser.error("--ep needs sizes >= 2: at EP 1 nothing is exchanged")
    if not args.push_programs or any(n is not None and n < 1 for n in args.push_programs):
        parser.error("--push-programs needs auto or numbers >= 1")
    if not args.free_sms or min(args.free_sms) < 0:
        parser.error("--free-sms needs numbers >= 0")
    for name in ("tokens", "hidden", "ffn", "experts", "top_k", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    return args


def bench_overlap(args, ep: int, device, programs: Optional[int]) -> list:
    """The rows of one EP size and push-program count: the three parts as graphs, for each count
    of multiprocessors the products leave free."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dmoe_kernels.launch import leave_multiprocessors_free
    from megatron_dmoe.moe.exchange.dispatcher import ExpertParallelDispatcher
    from megatron_dmoe.moe.exchange.symmetric import SymmetricExchanges
    from megatron_dmoe.moe.experts.sparse import SparseBackend
    from megatron_dmoe.parallel.expert_layout import ExpertLayout

    dtype = torch.bfloat16
    layout = ExpertLayout(args.experts, args.ffn, ep, ps.get_expert_model_parallel_rank())
    dispatcher = ExpertParallelDispatcher(layout, ps.get_expert_model_parallel_group(), "symmetric",
                                          rows_consumed_at_once=True)
    dispatcher.exchanges = SymmetricExchanges()
    dispatcher.exchanges.set_push_programs(programs)
    generator = torch.Generator(device=device).manual_seed(3000 + dist.get_rank())

    def chunk():
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=generator)
        return (x, *_random_routing(args, args.tokens, device, dtype, generator))

    first, second = chunk(), chunk()
    experts, f = layout.num_local_experts, layout.local_ffn_hidden_size
    w1 = torch.randn(experts, f, args.hidden, device=device, dtype=dtype, generator=generator) * args.hidden ** -0.5
    w2 = torch.randn(experts, f, args.hidden, device=device, dtype=dtype, generator=generator) * f ** -0.5
    backend = SparseBackend()
    with torch.no_grad():
        # the first chunk's rows, received once and kept apart from the buffers the second one reuses
        x_recv, _, state = dispatcher.dispatch(*first)
        x_recv, counts = x_recv.clone(), dispatcher.counts_by_source(state).clone()
    side = torch.cuda.Stream(device)

    def run_experts():
        backend.mlp_in_arrival_order(x_recv, counts, w1, None, w2, "gelu", False)

    def run_exchange():
        rows, _, exchange_state = dispatcher.dispatch(*second)
        dispatcher.combine(rows, exchange_state)

    def run_both():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run_exchange()
        run_experts()
        torch.cuda.current_stream(device).wait_stream(side)

    def timed(fn, free):
        with leave_multiprocessors_free(free):  # the grids are fixed when the graph is captured
            return _graph_timed(fn, args, device)

    with torch.no_grad():
        for fn in (run_experts, run_exchange, run_both):  # compiled, buffers made, before any capture
            fn()
        torch.cuda.synchronize(device)
        exchange_s, full_s = timed(run_exchange, 0), timed(run_experts, 0)
        rows = []
        for free in args.free_sms:
            experts_s = full_s if free == 0 else timed(run_experts, free)
            both_s = timed(run_both, free)
            rows.append({
                "ep": ep, "push_programs": "auto" if programs is None else str(programs), "free_sms": free,
                "local_experts": experts, "tokens_per_rank": args.tokens, "experts_ms": 1e3 * experts_s,
                "exchange_ms": 1e3 * exchange_s, "both_ms": 1e3 * both_s,
                "hidden": (full_s + exchange_s - both_s) / exchange_s,
            })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap: needs CUDA GPUs of one host (the symmetric exchange and CUDA graphs); "
                         "run it under torchrun with one process per GPU")
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything

    env = init_distributed("cuda")
    results = {"world_size": env.world_size, "gpu": torch.cuda.get_device_name(env.device),
               "versions": {"torch": torch.__version__}, "args": {k: v for k, v in vars(args).items() if k != "out"},
               "rows": [], "skipped_ep": []}
    try:
        for ep in args.ep:
            if env.world_size % ep or args.experts % ep:
                results["skipped_ep"].append(ep)
                continue
            init_distributed("cuda", expert_model_parallel_size=ep)
            seed_everything(1234, env)
            for programs in args.push_programs:
                results["rows"] += bench_overlap(args, ep, env.device, programs)
        if env.is_main:
            print(f"{env.world_size} processes, one {results['gpu']} each; bf16, {args.experts} experts top-"
                  f"{args.top_k}, hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens per rank and chunk; "
                  "CUDA graphs, slowest rank")
            print(format_table(results["rows"], COLUMNS))
            if results["skipped_ep"]:
                print(f"skipped EP sizes {results['skipped_ep']}: they must divide the {env.world_size} processes "
                      f"and the {args.experts} experts")
            if args.out:
                write_json(args.out, results)
    finally:
        destroy_distributed()
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
