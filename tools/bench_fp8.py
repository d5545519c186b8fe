#!/usr/bin/env python
"""Time block-scaled fp8 (e4m3) matrix products against bf16 on one GPU.

Five rows per shape:
  bf16               torch.matmul of the bf16 operands (cuBLAS): the baseline
  fp8                dmoe_kernels.fp8.ops.matmul (Triton) on operands already quantized: its
                     pipelined TMA kernel where the layouts allow
  fp8 pointers       the same through its pointer kernel (tma=False), the earlier path
  fp8+quant          the same with the quantization of its activation operands (quantize_rows) that
                     a training step pays: x in the forward, dy^T and x^T in the weight gradient
  fp8 _scaled_mm     torch._scaled_mm (cuBLAS) with the same 1 x 128 / 128 x 128 scales, where this
                     torch and GPU take block scales; otherwise the row says why not
Shapes (SHAPES): forward products x [M, K] @ W^T (W [N, K] in 128 x 128 blocks: the first expert
linear, K the model width, N the ffn width) and a weight gradient dy^T [M, K] @ x [K, N] whose K is
the tokens (both operands in 1 x 128 tiles along the tokens). Each fp8 result is first checked
against the float64 product of its dequantized operands (max |c - ref| / max |ref|); above
MAX_REL_ERROR the row is flagged and the exit code is 1. TFLOP/s count 2 M N K; "vs bf16" is the
bf16 time over the row's. Times: triton.testing.do_bench, median. A table on stdout, JSON with --out.

  python tools/bench_fp8.py [--shapes mixtral,zoo-small-wgrad,4096x4096x4096,3072x768x32768:wgrad]
                            [--precise] [--out fp8.json]
  python tools/bench_fp8.py --toy   # tiny shapes on CPU through Triton's interpreter, the Triton rows
                                    # only (cuBLAS and _scaled_mm need a GPU): a test of this program
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_moe, beside this file
from bench_moe import time_ms  # noqa: E402

# name: (M, N, K, kind). forward: x [M, K] @ W^T with W [N, K]; wgrad: dy^T [M, K] @ x [K, N],
# W's gradient (M = ffn, N = model width, K = tokens).
SHAPES = {
    # one expert's rows at EP 8 (bench_moe's paper-medium-ep8): 8 GPUs x 16384 tokens, top-1 of 64 experts
    "paper-medium": (2048, 4096, 1024, "forward"),
    # one expert's rows: 16384 tokens, top-2 of 8 experts
    "mixtral": (4096, 14336, 4096, "forward"),
    # the zoo's dense Small: micro-batch 32 x sequence 1024
    "zoo-small-dense": (32768, 3072, 768, "forward"),
    "zoo-small-wgrad": (3072, 768, 32768, "wgrad"),
}
TOY_SHAPES = {"toy-forward": (64, 48, 256, "forward"), "toy-wgrad": (48, 32, 192, "wgrad")}
KINDS = ("forward", "wgrad")
# max |c - ref| / max |ref| allowed of an fp8 product against float64 on the same fp8 operands. Its
# error is the bf16 output's rounding (2^-9 of an element) plus the fp8 tensor cores' accumulation
# within each 128 of K (about 14 bits kept, DeepSeek-V3's report; promoted to fp32 after each): about
# 1e-3 of the largest element on random data. 2e-2 leaves room for that and still catches a wrong
# scale or layout, whose errors are of order 1.
MAX_REL_ERROR = 2e-2
FP8_DOTS = (8, 9)  # compute capability of the first fp8 tensor cores (Ada)
LABELS = {
    "bf16": "bf16 torch.matmul (cuBLAS)",
    "fp8": "fp8 Triton ops.matmul",
    "fp8_pointers": "fp8 Triton, pointer kernel",
    "fp8+quant": "fp8 Triton + quantize_rows",
    "scaled_mm": "fp8 torch._scaled_mm (cuBLAS)",
    "scaled_mm_w_rows": "fp8 _scaled_mm, W in 1x128 rows",
}


def _parse_shape(spec: str, table: dict):
    if spec in table:
        return spec, table[spec]
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?::(\w+))?", spec)
    if not match or (match[4] or "forward") not in KINDS:
        raise ValueError(spec)
    m, n, k = (int(v) for v in match.groups()[:3])
    return spec, (m, n, k, match[4] or "forward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated names ({', '.join(SHAPES)}) or MxNxK (a forward product) or "
                        f"MxNxK:wgrad (a weight gradient, K the tokens); default all named")
    p.add_argument("--precise", action="store_true",
                   help="the Triton product promotes into fp32 after every tensor-core instruction instead "
                        "of every 128 of K (DeepSeek-V3's scheme, the default)")
    p.add_argument("--rep-ms", type=float, default=100, help="do_bench repetition time per row (default 100)")
    p.add_argument("--tma-configs", default="", metavar="BM:BN:STAGES:WARPS,...",
                   help="also time the TMA product under these tiles (ops.matmul's tma_config)")
    p.add_argument("--toy", action="store_true",
                   help="tiny shapes on CPU through Triton's interpreter, Triton rows only (tests this program)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.toy:
        args.shapes = ",".join(TOY_SHAPES)
    try:
        args.shape_list = [_parse_shape(s, {**SHAPES, **TOY_SHAPES}) for s in args.shapes.split(",") if s]
    except ValueError as exc:
        p.error(f"--shapes: {exc} is neither a named shape ({', '.join(SHAPES)}) nor MxNxK[:wgrad]")
    args.tma_list = []
    for text in (c for c in args.tma_configs.split(",") if c):
        parts = text.split(":")
        if len(parts) != 4 or not all(v.isdigit() and int(v) > 0 for v in parts):
            p.error(f"--tma-configs: {text!r} is not BM:BN:STAGES:WARPS (four positive whole numbers)")
        args.tma_list.append(tuple(int(v) for v in parts))
    return args


def _operands(kind, m, n, k, dev, dtype, ops):
    """One shape's operands as a training step holds them: (its bf16 product, the fp8 operands
    (aq, sa, bq, sb) of ops.matmul, a product that quantizes its activation operands first, and the
    dequantized operands in float64)."""
    from dmoe_kernels.fp8 import reference as ref

    f64 = torch.float64
    if kind == "forward":
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
        aq, sa = ops.quantize_rows(x)
        wq, ws = ops.quantize_blocks(w)
        bq, sb = wq.t(), ws.t()  # W's blocks serve W^T (ops.matmul takes the transposes)

        def with_quant(**kw):
            xq, xs = ops.quantize_rows(x)
            return ops.matmul(xq, xs, bq, sb, **kw)

        # W in 1 x 128 tiles of its rows (a scale per output column per 128 of K): the layout
        # cuBLAS takes for both operands where it refuses 128 x 128 blocks
        wrq, wrs = ops.quantize_rows(w)
        w_rows = (wrq.t(), wrs.t().contiguous(), ref.dequantize_rows(wrq, wrs, f64).t())
        return (lambda: torch.matmul(x, w.t()), (aq, sa, bq, sb), with_quant,
                ref.dequantize_rows(aq, sa, f64), ref.dequantize_blocks(wq, ws, f64).t(), w_rows)
    dy = torch.randn(k, m, device=dev, dtype=dtype)
    x = torch.randn(k, n, device=dev, dtype=dtype)
    # both quantized along the tokens, read through their transposes where they lie
    aq, sa = ops.quantize_rows(dy.t())
    xq, xs = ops.quantize_rows(x.t())

    def with_quant(**kw):
        gq, gs = ops.quantize_rows(dy.t())
        tq, ts = ops.quantize_rows(x.t())
        return ops.matmul(gq, gs, tq.t(), ts.t(), **kw)

    return (lambda: torch.matmul(dy.t(), x), (aq, sa, xq.t(), xs.t()), with_quant,
            ref.dequantize_rows(aq, sa, f64), ref.dequantize_rows(xq, xs, f64).t(), None)


def _scaled_mm_calls(kind, aq, sa, bq, sb, out_dtype):
    """torch._scaled_mm with these block scales, in each layout its versions have asked for, to try
    in order. It takes a row-major and b column-major (as given), scales that multiply (as ours),
    a's 1 x 128 ones outer-dim-major ([M, K/128], strides (1, M)) and b's as b^T's, transposed:
    1 x 128 ones [K/128, N] row-major; 128 x 128 ones [K/128, N/128] with strides (1, L), L being
    ceil(K/128) rounded up to 4 (cuBLAS's documented layout; torch's newer checks) or not (older)."""
    aq, bq = aq.contiguous(), bq.t().contiguous().t()  # no copies for ops' operands
    scale_a = sa.t().contiguous().t()
    if kind == "wgrad":
        layouts = {"1x128 x 1x128": sb.contiguous()}
    else:
        k_tiles, n_tiles = sb.shape
        layouts = {}
        for lead in dict.fromkeys((-(-k_tiles // 4) * 4, k_tiles)):
            padded = sb.new_zeros(n_tiles, lead)
            padded[:, :k_tiles] = sb.t()
            layouts[f"1x128 x 128x128, scale rows of {lead}"] = padded[:, :k_tiles].t()
    return {name: (lambda s=s: torch._scaled_mm(aq, bq, scale_a=scale_a, scale_b=s, out_dtype=out_dtype,
                                                  use_fast_accum=False))
            for name, s in layouts.items()}


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _pick_scaled_mm(kind, fp8_operands, out_dtype, exact):
    """(layout, call, its result) for the first layout this torch runs and reads right (one it
    accepts may still be read otherwise by cuBLAS: torch 2.11 takes padded 128 x 128 scale rows
    and reads them unpadded), or (None, None, why not)."""
    if not hasattr(torch, "_scaled_mm"):
        return None, None, "this torch has no torch._scaled_mm"
    errors = []
    for layout, call in _scaled_mm_calls(kind, *fp8_operands, out_dtype).items():
        try:
            c = call()
            torch.cuda.synchronize()
            err = _rel_error(c, exact)
            if err <= MAX_REL_ERROR:
                return layout, call, c
            errors.append(f"scales {layout}: wrong result ({err:.1e})")
        except Exception as exc:  # an older torch, a cuBLAS without block scales, another layout
            errors.append(_first_line(exc))
    return None, None, " | ".join(dict.fromkeys(errors))


def _rel_error(c, exact) -> float:
    return float((c.double() - exact).abs().max() / exact.abs().max())


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.toy:
        if not torch.cuda.is_available():
            raise SystemExit("bench_fp8: needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or "
                             "newer); --toy runs tiny shapes on CPU")
        cap = torch.cuda.get_device_capability()
        if cap < FP8_DOTS:
            raise SystemExit(f"bench_fp8: this GPU ({torch.cuda.get_device_name()}, compute capability "
                             f"{cap[0]}.{cap[1]}) has no fp8 tensor cores (8.9 or newer)")
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
    from dmoe_kernels.fp8 import kernels, ops
    from dmoe_kernels.launch import interpreted

    if args.toy and not interpreted(kernels.matmul_kernel):
        raise SystemExit("bench_fp8: --toy needs Triton's interpreter, but triton was imported without "
                         "TRITON_INTERPRET=1; run it in a fresh process")

    torch.manual_seed(0)
    dev = torch.device("cpu" if args.toy else "cuda")
    dtype = torch.float32 if args.toy else torch.bfloat16  # the interpreter's bf16 products are wrong
    def bench(fn, rep_ms):  # do_bench's median on a GPU, the median of 3 calls on the CPU
        return time_ms(fn, (), dev, rep_ms)
    fp8_kw = {"out_dtype": dtype, "precise": args.precise}

    rows = []
    for name, (m, n, k, kind) in args.shape_list:
        flops = 2.0 * m * n * k
        plain, fp8_operands, with_quant, a64, b64, w_rows = _operands(kind, m, n, k, dev, dtype, ops)
        exact = a64 @ b64
        exact_w_rows = a64 @ w_rows[2] if w_rows is not None and not args.toy else None
        del a64, b64
        calls = {"fp8": lambda: ops.matmul(*fp8_operands, **fp8_kw),
                 "fp8_pointers": lambda: ops.matmul(*fp8_operands, tma=False, **fp8_kw),
                 "fp8+quant": lambda: with_quant(**fp8_kw)}
        for cfg in args.tma_list:
            calls[f"fp8_tma {':'.join(map(str, cfg))}"] = (
                lambda cfg=cfg: ops.matmul(*fp8_operands, tma_config=cfg, **fp8_kw))
        notes = {}
        if not args.toy:
            layout, call, result = _pick_scaled_mm(kind, fp8_operands, dtype, exact)
            if call is None:
                notes["scaled_mm"] = f"not supported here: {result}"
            else:
                calls["scaled_mm"], notes["scaled_mm"] = call, f"scales {layout}"
        errors = {impl: _rel_error(call(), exact) for impl, call in calls.items()}
        if exact_w_rows is not None:
            aq, sa = fp8_operands[:2]
            layout, call, result = _pick_scaled_mm("wgrad", (aq, sa, *w_rows[:2]), dtype, exact_w_rows)
            if call is None:
                notes["scaled_mm_w_rows"] = f"not supported here: {result}"
            else:
                calls["scaled_mm_w_rows"], notes["scaled_mm_w_rows"] = call, f"scales {layout}"
                errors["scaled_mm_w_rows"] = _rel_error(result, exact_w_rows)
        del exact, exact_w_rows
        if not args.toy:
            torch.cuda.empty_cache()
            calls = {"bf16": plain, **calls}
        times = {impl: bench(call, args.rep_ms) for impl, call in calls.items()}
        base = times.get("bf16")
        for impl in [*LABELS, *(c for c in calls if c.startswith("fp8_tma "))]:
            if impl not in calls and impl not in notes:
                continue  # toy: cuBLAS's rows need a GPU
            ms = times.get(impl)
            err = errors.get(impl)
            rows.append({
                "shape": name, "kind": kind, "m": m, "n": n, "k": k, "impl": impl,
                "label": LABELS.get(impl, f"fp8 Triton TMA {impl[8:]}"),
                "ms": ms, "tflops": flops / ms / 1e9 if ms else None,
                "speedup_vs_bf16": base / ms if base and ms else None,
                "max_rel_error": err, "ok": None if err is None else err <= MAX_REL_ERROR,
                "note": notes.get(impl, ""),
            })

    device = "cpu (Triton's interpreter)" if args.toy else torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}; fp8 checked against float64 on the dequantized operands, "
          f"bound {MAX_REL_ERROR:g} (max |diff| / max |ref|); Triton promotion "
          f"{'every instruction' if args.precise else 'every 128 of K'}"
          f"{'; toy: Triton rows only (no cuBLAS or _scaled_mm on CPU)' if args.toy else ''}")
    print(f"{'shape':18s} {'M x N x K':>20s}  {'product':30s} {'ms':>9s} {'TFLOP/s':>8s} {'vs bf16':>8s} "
          f"{'max rel err':>11s}")
    for r in rows:
        dims = f"{r['m']}x{r['n']}x{r['k']}"
        head = f"{r['shape']:18s} {dims:>20s}  {r['label']:30s}"
        if r["ms"] is None:
            print(f"{head} {r['note']}")
            continue
        vs = f"{r['speedup_vs_bf16']:7.2f}x" if r["speedup_vs_bf16"] else f"{'-':>8s}"
        err = f"{r['max_rel_error']:11.1e}" if r["max_rel_error"] is not None else f"{'-':>11s}"
        flag = "  FAILS the bound" if r["ok"] is False else ""
        note = f"  ({r['note']})" if r["note"] else ""
        print(f"{head} {r['ms']:9.3f} {r['tflops']:8.1f} {vs} {err}{flag}{note}")
    if args.out:
        import triton

        out_args = {key: value for key, value in vars(args).items() if not key.endswith("_list")}
        with open(args.out, "w") as fh:
            json.dump({"args": out_args, "device": device, "torch": torch.__version__, "triton": triton.__version__,
                       "max_rel_error_bound": MAX_REL_ERROR, "rows": rows}, fh, indent=1)
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
