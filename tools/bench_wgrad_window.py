#!/usr/bin/env python
"""Time one full weight-gradient window (moe.expert_wgrad_window) with each epilogue of its product:
out's tiles added through pointers or by the TMA's bulk reduce-add (the default on Hopper).

The product alone (WindowSlots' dsdt_window_kernel with the window full), at the zoo Small's
one-GPU shapes by default: 64 experts of width 3072, hidden 768, 32768 routed rows per micro-batch
(micro-batch 32 x 1024 tokens, top-1), block 128, bf16 operands, fp32 out (main_grad), W = 4.
Loads are balanced (every expert the same rows) or drawn skewed (--skew: Dirichlet shares, as a
fresh router's). Useful TFLOP/s count the routed rows only (2 * W * rows * width * hidden). Beside
them, for scale, torch.bmm over the same per-expert shapes (bf16, balanced) and the empty launch
(the window not full: every program returns), which a captured backward pays at every other
micro-batch. Both epilogues' results are compared bit for bit first. A row with the tiles taken in
expert order, not longest first, shows what the product's order buys (its sums must be equal bit
for bit too). --configs times the pointer
epilogue under other tile configurations (BLOCK_N x BLOCK_K x stages x warps x programs per SM),
each checked against the default's sum first (same operands, other K splits: within 1e-5 of its
largest value); one that does not compile for this GPU is listed as such.

Times: triton.testing.do_bench, median. A table on stdout, JSON with --out.

  python tools/bench_wgrad_window.py [--experts 64 --width 3072 --hidden 768 --rows 32768 --window 4]
                                     [--skew] [--configs 128x64x3x4x2,...] [--out wgrad_window.json]
  python tools/bench_wgrad_window.py --toy   # tiny shapes on CPU (Triton's interpreter, the pointer
                                             # epilogue only): a test of this program
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_moe, beside this file
from bench_moe import time_ms  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64, help="local experts (default 64)")
    p.add_argument("--width", type=int, default=3072, help="expert ffn width (default 3072)")
    p.add_argument("--hidden", type=int, default=768, help="model width, the product's n (default 768)")
    p.add_argument("--rows", type=int, default=32768, help="routed rows per micro-batch (default 32768)")
    p.add_argument("--window", type=int, default=4, help="micro-batches per window (default 4)")
    p.add_argument("--block-size", type=int, default=128, help="sparse block (default 128)")
    p.add_argument("--skew", action="store_true", help="skewed loads (Dirichlet(0.3) shares) instead of balanced")
    p.add_argument("--configs", default="",
                   help="more tile configs to time with the pointer epilogue, comma-separated "
                        "BLOCK_NxBLOCK_KxSTAGESxWARPSxPROGRAMS_PER_SM (e.g. 128x64x3x4x2)")
    p.add_argument("--rep-ms", type=float, default=200, help="do_bench repetition time (default 200)")
    p.add_argument("--toy", action="store_true",
                   help="tiny shapes on CPU through Triton's interpreter, pointer epilogue only (tests this program)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        args.config_list = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
        assert all(len(c) == 5 for c in args.config_list)
    except (ValueError, AssertionError):
        p.error(f"--configs {args.configs!r}: give comma-separated BLOCK_NxBLOCK_KxSTAGESxWARPSxPROGRAMS_PER_SM, "
                "e.g. 128x64x3x4x2")
    if args.toy:
        args.experts, args.width, args.hidden, args.rows, args.block_size = 4, 32, 24, 96, 16
    return args


def _loads(args):
    if not args.skew:
        base = torch.full((args.experts,), args.rows // args.experts)
        base[: args.rows - int(base.sum())] += 1
        return base
    shares = torch.distributions.Dirichlet(torch.full((args.experts,), 0.3)).sample()
    counts = torch.floor(shares * args.rows).long()
    counts[torch.argmax(counts)] += args.rows - int(counts.sum())
    return counts


def _config_row(cfg, W, micro, reference, flops, bench, rep_ms):
    """One --configs entry: the window's sum checked against the default config's, then timed."""
    from dmoe_kernels.products.tuning import DsdConfig
    from dmoe_kernels.products.window import WindowSlots

    block_n, block_k, stages, warps, per_sm = cfg
    name = f"pointers {block_n}x{block_k} s{stages} w{warps} p{per_sm}"
    config = DsdConfig(block_n=block_n, block_k=block_k, group_m=8, num_warps=warps, num_stages=stages,
                       persistent=True, programs_per_sm=per_sm)
    out = torch.zeros_like(reference)
    try:
        slots = WindowSlots(W, *micro[0], epilogue="pointers", config=config)
        for data, topo, b in micro:
            slots.add(data, topo, b, out)
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # a config beyond this GPU's shared memory or registers
        return {"epilogue": name, "ms": None, "tflops": None, "empty_launch_us": None,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    error = float((out - reference).abs().max() / reference.abs().max())
    slots.counter.fill_(W - 1)
    full = bench(lambda: slots._product(out), rep_ms)
    return {"epilogue": name, "ms": full, "tflops": flops / full / 1e9, "empty_launch_us": None,
            "max_rel_error": error, "agrees": error <= 1e-5}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.toy and not torch.cuda.is_available():
        raise SystemExit("bench_wgrad_window: needs a CUDA GPU (the TMA reduce epilogue runs on Hopper or newer); "
                         "--toy runs tiny shapes on CPU")
    if args.toy:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
    import dmoe_kernels as dk
    from dmoe_kernels.products.window import EPILOGUES, WindowSlots

    torch.manual_seed(0)
    dev = torch.device("cpu" if args.toy else "cuda")
    bf = torch.float32 if args.toy else torch.bfloat16  # the interpreter's bf16 products are wrong
    epilogues = ("pointers",) if args.toy else EPILOGUES
    def bench(fn, rep_ms):  # do_bench's median on a GPU, the median of 3 calls on the CPU
        return time_ms(fn, (), dev, rep_ms)
    W, E, f, d, bs = args.window, args.experts, args.width, args.hidden, args.block_size
    micro = []
    for _ in range(W):
        counts = _loads(args).to(dev)
        topo = dk.Topology.for_experts(counts, args.rows, f, bs)
        micro.append((torch.randn(topo.data_shape(), device=dev, dtype=bf), topo,
                      torch.randn(topo.shape[0], d, device=dev, dtype=bf)))
    outs, slots = {}, {}
    for epilogue in epilogues:
        out = torch.zeros(E * f, d, device=dev)
        slots[epilogue] = WindowSlots(W, *micro[0], epilogue=epilogue)
        for data, topo, b in micro:
            slots[epilogue].add(data, topo, b, out)
        outs[epilogue] = out
    same = all(torch.equal(outs["pointers"], out) for out in outs.values())
    flops = 2.0 * W * args.rows * f * d

    rows = []
    for epilogue, s in slots.items():
        out = torch.zeros(E * f, d, device=dev)
        s.counter.fill_(W - 1)  # the window full: _product does the whole sum (and leaves the counter)
        full = bench(lambda: s._product(out), args.rep_ms)
        s.counter.fill_(0)  # not full: every program returns at once
        empty = bench(lambda: s._product(out), args.rep_ms)
        rows.append({"epilogue": epilogue, "ms": full, "tflops": flops / full / 1e9, "empty_launch_us": empty * 1e3})
    # the tiles in expert order instead of longest first (what the order buys), same sums
    s = slots[epilogues[-1]]
    by_work = s.order.clone()
    s.order.copy_(torch.arange(E, device=dev, dtype=s.order.dtype))
    s.counter.fill_(W - 1)
    out = torch.zeros(E * f, d, device=dev)
    s._product(out)
    unordered_same = torch.equal(out, outs[epilogues[-1]])
    # before timing: every timed call adds into out again
    error = float((out - outs[epilogues[-1]]).abs().max() / outs[epilogues[-1]].abs().max())
    full = bench(lambda: s._product(out), args.rep_ms)
    s.order.copy_(by_work)
    rows.append({"epilogue": f"{epilogues[-1]}, tiles in expert order", "ms": full, "tflops": flops / full / 1e9,
                 "empty_launch_us": None, "agrees": unordered_same, "max_rel_error": error})

    for cfg in args.config_list:
        rows.append(_config_row(cfg, W, micro, outs["pointers"], flops, bench, args.rep_ms))

    per_expert = W * args.rows // E
    a = torch.randn(E, f, per_expert, device=dev, dtype=bf)
    b = torch.randn(E, per_expert, d, device=dev, dtype=bf)
    bmm = bench(lambda: torch.bmm(a, b), args.rep_ms)
    rows.append({"epilogue": "torch.bmm (operands' dtype out, balanced, for scale)", "ms": bmm,
                 "tflops": 2.0 * E * f * per_expert * d / bmm / 1e9, "empty_launch_us": None})

    print(f"window {W} x {args.rows} rows, {E} experts of {f} x {d}, block {bs}, "
          f"{'skewed' if args.skew else 'balanced'} loads; epilogues equal bit for bit: {same}"
          f"{' (toy: pointers only)' if args.toy else ''}")
    print(f"{'epilogue':44s} {'ms':>8s} {'TFLOP/s':>8s} {'empty launch us':>16s}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['epilogue']:44s} does not run here: {r['error']}")
            continue
        empty = f"{r['empty_launch_us']:16.1f}" if r["empty_launch_us"] is not None else f"{'-':>16s}"
        note = "" if r.get("agrees", True) else f"  DIFFERS from the default by {r['max_rel_error']:.2e}"
        print(f"{r['epilogue']:44s} {r['ms']:8.3f} {r['tflops']:8.1f} {empty}{note}")
    if args.out:
        device = "cpu (interpreter)" if args.toy else torch.cuda.get_device_name()
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "device": device, "equal": same, "rows": rows}, fh, indent=1)
    return 0 if same and all(r.get("agrees", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
