#!/usr/bin/env python
"""Time the expert MLP's block-sparse products in block-scaled fp8 against the same products in bf16.

For each case of the benchmark table (bench_moe.py's CASES, balanced routing: every expert gets
T*k/E tokens), on the dMoE topology, the four products that fp8 takes (products/fp8_ops.py):

  fwd_sdd   h  = x  @ w1^T   sdd_fp8: x in 1 x 128 row tiles, w1 in 128 x 128 blocks
  fwd_dsd   y  = a  @ w2     dsd_fp8: a's blocks with a scale per row, w2 in 128 x 128 blocks, read
                             K-major (w2's transpose quantized once: fp8 tensor cores take the
                             right operand K-major); fwd_dsd_row_major_w: w2 as stored, for comparison
  bwd_sdd   da = dy @ w2^T   sdd_fp8
  bwd_dx    dx = dh @ w1     dsd_fp8, w1 K-major likewise

each beside the bf16 product (dmoe_kernels.ops.sdd / dsd with their default configs) on the same
values, operands already quantized (what the quantization costs is its own row: quantize_rows of x
and quantize_blocks_rows of a); --sdd-configs / --dsd-configs add rows of the forward products under
other tile configs (fp8_ops.Fp8Config). Each fp8 result's first block row (expert 0's first rows) is checked
first against float64 on its dequantized operands (max |diff| / max |ref|, bound MAX_REL_ERROR).
TFLOP/s count 2 T k d f per product (never the padding). Times: triton.testing.do_bench, median.
A table on stdout, JSON with --out.

  python tools/bench_fp8_experts.py [--cases paper-medium,mixtral] [--out fp8_experts.json]
  python tools/bench_fp8_experts.py --toy   # tiny cases on CPU through Triton's interpreter (fp8
                                            # rows only): a test of this program
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_moe, beside this file
from bench_moe import CASES, time_ms  # noqa: E402

# the interpreter's tiny cases: (T, d, f, E, k), widths that fill 16-wide blocks and 16-byte rows
TOY_CASES = {"toy-top1": (64, 128, 64, 4, 1), "toy-top2": (48, 144, 32, 3, 2)}
# an fp8 product against float64 on the same fp8 values: the bf16 output's rounding and the tensor
# cores' accumulation within each 128 of K (bench_fp8.py's bound)
MAX_REL_ERROR = 2e-2
PRODUCTS = ("fwd_sdd", "fwd_dsd", "fwd_dsd_row_major_w", "bwd_sdd", "bwd_dx")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="paper-medium,mixtral", help="comma-separated cases of bench_moe.py's CASES")
    p.add_argument("--rep-ms", type=float, default=100, help="do_bench repetition time per measurement")
    p.add_argument("--sdd-configs", default="", metavar="NB:SPLIT:STAGES:WARPS:PER_SM,...",
                   help="also time sdd_fp8 under these tile configs (products/fp8_ops.Fp8Config)")
    p.add_argument("--dsd-configs", default="", metavar="BLOCK_N:SPLIT:STAGES:WARPS:PER_SM,...",
                   help="also time dsd_fp8 under these tile configs")
    p.add_argument("--toy", action="store_true", help="tiny cases on CPU through Triton's interpreter")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    table = TOY_CASES if args.toy else CASES
    args.case_list = list(table) if args.toy else [c for c in args.cases.split(",") if c]
    from dmoe_kernels.products.fp8_ops import Fp8Config

    try:
        args.sdd_list = [Fp8Config.parse(c) for c in args.sdd_configs.split(",") if c]
        args.dsd_list = [Fp8Config.parse(c) for c in args.dsd_configs.split(",") if c]
    except ValueError as exc:
        p.error(str(exc))
    for name in args.case_list:
        if name not in table:
            p.error(f"--cases: {name!r} is not a case of {sorted(table)}")
    return args


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def measure(name, table, dev, rep_ms, toy, sdd_configs=(), dsd_configs=()):
    import dmoe_kernels as dk
    from dmoe_kernels.fp8 import ops as q8, reference as fp8_ref
    from dmoe_kernels.products import fp8_ops

    T, d, f, E, k = table[name]
    bs = 16 if toy else 128
    counts = torch.full((E,), T * k // E, device=dev)
    topo = dk.Topology.for_experts(counts, T * k, f, bs)
    rows, dtype = topo.shape[0], torch.float32 if toy else torch.bfloat16  # the interpreter's bf16 dots are wrong
    x, dy = (torch.randn(rows, d, device=dev).to(dtype) for _ in range(2))
    w1, w2 = ((torch.randn(E * f, d, device=dev) * d ** -0.5).to(dtype) for _ in range(2))
    a, dh = (torch.randn(topo.data_shape(), device=dev).to(dtype) for _ in range(2))
    xq, xs = q8.quantize_rows(x)
    dyq, dys = q8.quantize_rows(dy)
    w1q, w1s = q8.quantize_blocks(w1)
    w2q, w2s = q8.quantize_blocks(w2)
    # the down-projection's products read the weights K-major: quantized from their transposes
    w1tq, w1ts = q8.quantize_blocks(w1.t())
    w2tq, w2ts = q8.quantize_blocks(w2.t())
    aq, as_ = fp8_ops.quantize_blocks_rows(a)
    dhq, dhs = fp8_ops.quantize_blocks_rows(dh)
    F = f // bs

    # The check: the first block row (expert 0's first bs rows) in float64 from the dequantized
    # operands; the whole product would not fit in float64 at the real cases.
    def deq_w(wq, ws):  # expert 0's rows of a weight [E*f, d]
        return fp8_ref.dequantize_blocks(wq[:f].cpu(), ws[:fp8_ref.tiles(f)].cpu(), torch.float64)

    def first_sdd(lq, ls, wq, ws):
        return fp8_ref.dequantize_rows(lq[:bs].cpu(), ls[:bs].cpu(), torch.float64) @ deq_w(wq, ws).t()

    def first_dsd(sq, ss, wq, ws):
        s64 = sq[:F].cpu().double() * ss[:F * bs].cpu().double().view(F, bs, 1)
        return s64.permute(1, 0, 2).reshape(bs, F * bs) @ deq_w(wq, ws)

    def sdd_row(out):  # the first block row's F blocks as [bs, F * bs]
        return out[:F].permute(1, 0, 2).reshape(bs, F * bs)

    def sdd8(lq, ls, wq, ws):
        return lambda c=None: fp8_ops.sdd_fp8(lq, ls, wq, ws, topo, config=c)

    def dsd8(sq, ss, wq, ws):
        return lambda c=None: fp8_ops.dsd_fp8(sq, ss, topo, wq, ws, config=c)

    calls = {
        "fwd_sdd": (lambda: dk.ops.sdd(x, w1.t(), topo), sdd8(xq, xs, w1q, w1s),
                    sdd_row, lambda: first_sdd(xq, xs, w1q, w1s)),
        "fwd_dsd": (lambda: dk.ops.dsd(a, topo, w2), dsd8(aq, as_, w2tq.t(), w2ts.t()),
                    lambda out: out[:bs], lambda: first_dsd(aq, as_, w2q, w2s)),
        "fwd_dsd_row_major_w": (None, dsd8(aq, as_, w2q, w2s),
                                lambda out: out[:bs], lambda: first_dsd(aq, as_, w2q, w2s)),
        "bwd_sdd": (lambda: dk.ops.sdd(dy, w2.t(), topo), sdd8(dyq, dys, w2q, w2s),
                    sdd_row, lambda: first_sdd(dyq, dys, w2q, w2s)),
        "bwd_dx": (lambda: dk.ops.dsd(dh, topo, w1), dsd8(dhq, dhs, w1tq.t(), w1ts.t()),
                   lambda out: out[:bs], lambda: first_dsd(dhq, dhs, w1q, w1s)),
    }
    flops = 2.0 * T * k * d * f
    rows_out = []
    for prod in PRODUCTS:
        bf16_fn, fp8_fn, view, expected = calls[prod]
        err = _max_rel(view(fp8_fn()), expected())
        row = {"case": name, "product": prod, "fp8_max_rel_error": err, "ok": err <= MAX_REL_ERROR}
        row["fp8_ms"] = time_ms(fp8_fn, [], dev, rep_ms)
        row["fp8_tflops"] = flops / row["fp8_ms"] / 1e9
        if not toy and bf16_fn is not None:
            row["bf16_ms"] = time_ms(bf16_fn, [], dev, rep_ms)
            row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        rows_out.append(row)
        for cfg in (sdd_configs if prod == "fwd_sdd" else dsd_configs if prod == "fwd_dsd" else ()):
            fn = lambda cfg=cfg: fp8_fn(cfg)  # noqa: E731
            err = _max_rel(view(fn()), expected())
            ms = time_ms(fn, [], dev, rep_ms)
            sweep = {"case": name, "product": f"{prod} {':'.join(map(str, cfg))}", "fp8_max_rel_error": err,
                     "ok": err <= MAX_REL_ERROR, "fp8_ms": ms, "fp8_tflops": flops / ms / 1e9}
            if "bf16_ms" in row:
                sweep["speedup"] = row["bf16_ms"] / ms
            rows_out.append(sweep)
    quant = {"quantize_rows_x_ms": time_ms(lambda: q8.quantize_rows(x), [], dev, rep_ms),
             "quantize_blocks_rows_a_ms": time_ms(lambda: fp8_ops.quantize_blocks_rows(a), [], dev, rep_ms)}
    return rows_out, {"case": name, **quant}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.toy:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
    elif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_fp8_experts: needs a Hopper GPU (TMA and fp8 tensor cores); --toy runs tiny cases "
                         "on CPU")
    from dmoe_kernels.launch import interpreted
    from dmoe_kernels.products.kernels import sparse_fp8

    if args.toy and not interpreted(sparse_fp8.sdd_fp8_kernel):
        raise SystemExit("bench_fp8_experts: --toy needs Triton's interpreter, but triton was imported without "
                         "TRITON_INTERPRET=1; run it in a fresh process")
    torch.manual_seed(0)
    dev = torch.device("cpu" if args.toy else "cuda")
    table = TOY_CASES if args.toy else CASES
    rows, quant = [], []
    for name in args.case_list:
        case_rows, case_quant = measure(name, table, dev, args.rep_ms, args.toy, args.sdd_list, args.dsd_list)
        rows += case_rows
        quant.append(case_quant)
    device = "cpu (Triton's interpreter)" if args.toy else torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}; fp8 checked against float64 on the dequantized operands "
          f"(bound {MAX_REL_ERROR:g}, max |diff| / max |ref|){'; toy: fp8 rows only' if args.toy else ''}")
    print(f"{'case':14s} {'product':24s} {'bf16 TFLOP/s':>12s} {'fp8 TFLOP/s':>11s} {'fp8 vs bf16':>11s} "
          f"{'max rel err':>11s}")
    for r in rows:
        bf16 = f"{r['bf16_tflops']:12.1f}" if "bf16_tflops" in r else f"{'-':>12s}"
        vs = f"{r['speedup']:10.2f}x" if "speedup" in r else f"{'-':>11s}"
        flag = "" if r["ok"] else "  FAILS the bound"
        print(f"{r['case']:14s} {r['product']:24s} {bf16} {r['fp8_tflops']:11.1f} {vs} "
              f"{r['fp8_max_rel_error']:11.1e}{flag}")
    for q in quant:
        print(f"{q['case']}: quantize_rows(x) {q['quantize_rows_x_ms']:.3f} ms, quantize_blocks_rows(a) "
              f"{q['quantize_blocks_rows_a_ms']:.3f} ms")
    if args.out:
        out_args = {key: value for key, value in vars(args).items() if not key.endswith("_list")}
        with open(args.out, "w") as fh:
            json.dump({"args": out_args, "device": device, "torch": torch.__version__, "rows": rows,
                       "quantization": quant, "max_rel_error_bound": MAX_REL_ERROR}, fh, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
