"""Benchmark the six block-sparse products of the dMoE expert MLP against dense cuBLAS matmuls.

For each case of the benchmark table (balanced routing: every expert gets T*k/E tokens), each
product runs on the dMoE topology built from the counts and is compared with one dense torch.matmul
of the same useful FLOPs, with the operand layouts a dense MLP would use:

  fwd_sdd   h   = x  @ w1^T     dense: [T*k, d] @ [d, f]
  fwd_dsd   y   = a  @ w2       dense: [T*k, f] @ [f, d]
  bwd_sdd   da  = dy @ w2^T     dense: [T*k, d] @ [d, f]
  bwd_dw2   dw2 = a^T @ dy      dense: [f, T*k] @ [T*k, d]
  bwd_dx    dx  = dh @ w1       dense: [T*k, f] @ [f, d]
  bwd_dw1   dw1 = dh^T @ x      dense: [f, T*k] @ [T*k, d]

FLOPs counted: 2*T*k*d*f per product (never the padding). Per case, the expert MLP's step adds them
up as the sparse experts run them: GELU six products (12*T*k*d*f), SwiGLU nine (18*T*k*d*f: fwd_sdd,
bwd_dx and bwd_dw1 once for w1 and once for v1). A case modelled on a SwiGLU model
(deepseek-v2-lite) is always SwiGLU; the others are GELU, or SwiGLU with --swiglu.
Times: triton.testing.do_bench, median, L2 flushed before each run, bf16 random data. Before timing,
each sparse product is checked against per-expert dense matmuls (exact for balanced routing whose
groups fill whole blocks). Beside them, cuBLAS's batched matmul (torch.bmm) of the same per-expert
problems: what the vendor library reaches on these shapes when routing happens to split the tokens
evenly (it cannot take uneven splits).

  python tools/bench_kernels.py --out results.json [--cases paper-small,deepseek-v2-lite] [--block-size 128]
                                [--swiglu]  # the MLP totals of the other cases as SwiGLU
                                [--sweep]   # also time a few configs per product; report the best
  python tools/bench_kernels.py --wgrad-accumulate   # weight gradients added into fp32 main_grad
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

import dmoe_kernels as dk

# one table of cases for the layer and its products (run from tools/)
from bench_moe import CASES, case_activation, profile_host
from dmoe_kernels import DsdConfig, SddConfig

PRODUCTS = ["fwd_sdd", "fwd_dsd", "bwd_sdd", "bwd_dw2", "bwd_dx", "bwd_dw1"]
# How often the expert MLP's step runs each product: SwiGLU's second input weight v1 repeats the
# products of w1 (moe/experts/sparse.py runs two SDDs on one topology rather than one over [w1; v1]).
PRODUCT_COUNT = {"gelu": dict.fromkeys(PRODUCTS, 1),
                 "swiglu": {**dict.fromkeys(PRODUCTS, 1), "fwd_sdd": 2, "bwd_dx": 2, "bwd_dw1": 2}}
FORM = {"fwd_sdd": "sdd", "bwd_sdd": "sdd", "fwd_dsd": "dsd", "bwd_dx": "dsd", "bwd_dw2": "dsdt", "bwd_dw1": "dsdt"}


def sweep_configs(form: str, bs: int):
    """A few alternatives to the defaults (persistent TMA kernels), to show how close they are."""
    P = dict(persistent=True)
    if form == "sdd":
        return [SddConfig(blocks_per_program=2, block_k=64, group_m=g, num_warps=8, num_stages=st, **P)
                for g, st in ((8, 3), (8, 4), (4, 4))]
    if form == "dsd":
        return [DsdConfig(block_n=bn, block_k=64, group_m=8, num_warps=w, num_stages=st, flatten=fl, **P)
                for bn, w, st, fl in ((256, 8, 3, True), (256, 8, 3, False), (128, 4, 4, True))]
    # Weight gradients (flatten=True: tile and K loops fused by hand).
    return [DsdConfig(block_n=bn, block_k=bk, group_m=g, num_warps=w, num_stages=st, flatten=fl, **P)
            for bn, bk, g, w, st, fl in ((256, 64, 8, 8, 3, True), (256, 64, 8, 8, 3, False),
                                         (256, 32, 8, 8, 6, True), (256, 64, 16, 8, 3, True), (128, 64, 8, 4, 4, True))]


def grouped(data: torch.Tensor, E: int, n: int, bs: int, F: int) -> torch.Tensor:
    """Sparse data of a balanced topology as dense per-expert [E, n, f] (n tokens, multiple of bs)."""
    nnz = E * (n // bs) * F
    return data[:nnz].view(E, n // bs, F, bs, bs).permute(0, 1, 3, 2, 4).reshape(E, n, F * bs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got.float() - want.float()).norm() / want.float().norm())


def check_case(name: str, bs: int) -> None:
    """The products are checked against per-expert matmuls on balanced routing: every expert's
    T*k/E tokens and its width f must be whole blocks."""
    T, d, f, E, k = CASES[name]
    if (T * k) % E or (T * k // E) % bs or f % bs:
        raise SystemExit(f"case {name}: balanced groups ({T}*{k}/{E} tokens per expert, width {f}) must fill "
                         f"whole blocks of {bs}; choose another --block-size or case")


def expert_mlp_totals(result: dict, activation: str) -> dict:
    """One step of the expert MLP from the products' times: each product as often as the step runs
    it (PRODUCT_COUNT), useful TFLOP/s of the whole (12 or 18 * T*k*d*f); ours, best, dense and bmm."""
    count = PRODUCT_COUNT[activation]
    products = result["products"]
    flops = 2.0 * result["T"] * result["top_k"] * result["d"] * result["f"] * sum(count.values())
    totals = {"activation": activation, "product_count": count, "flops": flops}
    for label in ("default", "best", "dense", "bmm"):
        ms = [p[label]["ms"] if label in ("default", "best") and p[label] else p.get(f"{label}_ms")
              for p in products.values()]
        if any(m is None for m in ms) or set(products) != set(PRODUCTS):
            continue  # a product without a time (every config failed): no total
        total = sum(count[prod] * m for prod, m in zip(products, ms))
        totals[f"{label}_ms"] = total
        totals[f"{label}_tflops"] = flops / (total * 1e-3) / 1e12
    return totals


def run_case(name: str, bs: int, sweep: bool, log, dtype: torch.dtype = torch.bfloat16, repeats: int = 3,
             profile: bool = False, activation: str = "gelu") -> dict:
    T, d, f, E, k = CASES[name]
    Tk = T * k
    check_case(name, bs)
    n = Tk // E
    F = f // bs
    dev = torch.device("cuda")
    bf = dtype
    counts = torch.full((E,), n, device=dev, dtype=torch.int32)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    topo = dk.Topology.for_experts(counts, Tk, f, bs)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    topo_ms = do_bench(lambda: dk.Topology.for_experts(counts, Tk, f, bs), warmup=5, rep=20, return_mode="median")
    rows = topo.shape[0]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(bf)

    x, dy = rnd(rows, d), rnd(rows, d)
    w1, w2 = rnd(E * f, d, scale=d ** -0.5), rnd(E * f, d, scale=d ** -0.5)
    a, dh = rnd(*topo.data_shape()), rnd(*topo.data_shape())
    ga, gdh = grouped(a, E, n, bs, F), grouped(dh, E, n, bs, F)
    W1, W2 = w1.view(E, f, d), w2.view(E, f, d)
    X, DY = x[:Tk].view(E, n, d), dy[:Tk].view(E, n, d)

    # (sparse call taking a config, expected result, how to compare, dense matmul of the same FLOPs)
    spec = {
        "fwd_sdd": (lambda c: dk.ops.sdd(x, w1.t(), topo, config=c),
                    lambda: torch.bmm(X, W1.transpose(1, 2)), lambda out: grouped(out, E, n, bs, F),
                    lambda: x[:Tk] @ w1[:f].t()),
        "bwd_sdd": (lambda c: dk.ops.sdd(dy, w2.t(), topo, config=c),
                    lambda: torch.bmm(DY, W2.transpose(1, 2)), lambda out: grouped(out, E, n, bs, F),
                    lambda: dy[:Tk] @ w2[:f].t()),
        "fwd_dsd": (lambda c: dk.ops.dsd(a, topo, w2, config=c),
                    lambda: torch.bmm(ga, W2), lambda out: out[:Tk].view(E, n, d),
                    lambda: ga.reshape(Tk, f) @ w2[:f]),
        "bwd_dx": (lambda c: dk.ops.dsd(dh, topo, w1, config=c),
                   lambda: torch.bmm(gdh, W1), lambda out: out[:Tk].view(E, n, d),
                   lambda: gdh.reshape(Tk, f) @ w1[:f]),
        "bwd_dw2": (lambda c: dk.ops.dsd(a, topo, dy, transpose=True, config=c),
                    lambda: torch.bmm(ga.transpose(1, 2), DY), lambda out: out.view(E, f, d),
                    lambda: ga.reshape(Tk, f).t() @ dy[:Tk]),
        "bwd_dw1": (lambda c: dk.ops.dsd(dh, topo, x, transpose=True, config=c),
                    lambda: torch.bmm(gdh.transpose(1, 2), X), lambda out: out.view(E, f, d),
                    lambda: gdh.reshape(Tk, f).t() @ x[:Tk]),
    }
    if profile:
        for prod in ("fwd_sdd", "bwd_dw1"):
            log(f"host profile of {prod}:\n" + profile_host(lambda: spec[prod][0](None)))
    flops = 2.0 * Tk * d * f
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    result = {"case": name, "T": T, "d": d, "f": f, "experts": E, "top_k": k, "block_size": bs,
              "topology_build_ms": topo_ms, "first_build_ms": build_ms, "products": {}}
    for prod in PRODUCTS:
        sparse_fn, expected_fn, view_fn, dense_fn = spec[prod]
        expected = expected_fn()
        configs = [None] + (sweep_configs(FORM[prod], bs) if sweep else [])
        tried = []
        for cfg in configs:
            label = "default" if cfg is None else str(cfg)
            try:
                out = sparse_fn(cfg)
                err = rel_err(view_fn(out), expected)
                if err > 2e-2:
                    tried.append({"config": label, "error": f"wrong result, rel err {err:.3g}"})
                    log(f"  {prod} {label}: WRONG rel err {err:.3g}")
                    continue
                ms = do_bench(lambda: sparse_fn(cfg), warmup=10, rep=50, return_mode="median")
            except Exception as exc:  # a config the compiler rejects (resources) is skipped
                tried.append({"config": label, "error": repr(exc)[:300]})
                log(f"  {prod} {label}: FAILED {repr(exc)[:200]}")
                continue
            tried.append({"config": label, "ms": ms, "tflops": tflops(ms), "rel_err": err})
        del expected
        timed = [t for t in tried if "ms" in t]
        best = min(timed, key=lambda t: t["ms"]) if timed else None
        default = tried[0] if "ms" in tried[0] else None
        best_cfg = configs[[c["config"] for c in tried].index(best["config"])] if best else None
        # Final numbers: default, best and dense timed alternately, three rounds, medians (clocks drift).
        rounds = {"default": [], "best": [], "dense": [], "bmm": []}
        for _ in range(repeats):
            if default:
                rounds["default"].append(do_bench(lambda: sparse_fn(None), warmup=10, rep=100, return_mode="median"))
            if best and sweep:
                rounds["best"].append(do_bench(lambda: sparse_fn(best_cfg), warmup=10, rep=100, return_mode="median"))
            rounds["dense"].append(do_bench(dense_fn, warmup=10, rep=100, return_mode="median"))
            rounds["bmm"].append(do_bench(expected_fn, warmup=10, rep=100, return_mode="median"))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        dense_ms, bmm_ms = med(rounds["dense"]), med(rounds["bmm"])
        if default:
            default = dict(default, ms=med(rounds["default"]), tflops=tflops(med(rounds["default"])))
        if best and sweep:
            best = dict(best, ms=med(rounds["best"]), tflops=tflops(med(rounds["best"])))
        elif default:
            best = default
        # Host cost of one call (Python, checks, launch): enqueue many calls without waiting.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            sparse_fn(None)
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        result["products"][prod] = {
            "dense_ms": dense_ms, "dense_tflops": tflops(dense_ms),
            "bmm_ms": bmm_ms, "bmm_tflops": tflops(bmm_ms),
            "default": default, "best": best, "tried": tried, "host_us_per_call": host_us,
            "rounds_ms": rounds,
        }
        log(f"  {name} {prod}: dense {tflops(dense_ms):6.1f}  default "
            f"{default['tflops'] if default else float('nan'):6.1f}  "
            f"best {best['tflops'] if best else float('nan'):6.1f} "
            f"{best['config'] if best else ''}  cuBLAS bmm {tflops(bmm_ms):6.1f}  host {host_us:.0f} us/call")
    result["mlp"] = expert_mlp_totals(result, activation)
    x = dy = w1 = w2 = a = dh = ga = gdh = None  # free them: the lambdas above hold these names
    torch.cuda.empty_cache()
    return result


def run_wgrad_accumulate(name: str, bs: int, log, dtype: torch.dtype = torch.bfloat16, micro_batches: int = 8,
                         tokens: int = 0, skew: float = 0.0) -> dict:
    """A weight gradient (dw1 = dh^T @ x) as training needs it: added into an fp32 gradient buffer
    (megatron's main_grad) once per micro-batch. Fused (the kernel's epilogue reads, adds, writes)
    against the bf16 product plus a separate add, and against the dense-equivalent matmul plus its
    add (a dense MLP of the same FLOPs has an E times smaller weight, so an E times smaller buffer).
    The floor: main_grad's read and write at the copy bandwidth of this GPU (an fp32 copy of the same
    size, 8 bytes per element), which no kernel doing the add can beat. Overwrite: the product
    stored into the fp32 buffer without reading it (a step's first micro-batch after zeroing).
    tokens: tokens per micro-batch instead of the case's T. skew: expert e gets tokens in proportion
    to (1 + e)^-skew instead of T*k/E each (the busiest expert's load over the mean is reported).

    Per step: the same gradient over `micro_batches` micro-batches as ONE product over their rows
    regrouped by expert (dmoe_kernels.permutation.ops; main_grad read and written once), reported per
    micro-batch next to the fused per-micro-batch time, with the regrouping (row sources and gathers) alone."""
    T, d, f, E, k = CASES[name]
    Tk = (tokens or T) * k
    n, dev = Tk // E, torch.device("cuda")
    counts = torch.full((E,), n, device=dev, dtype=torch.int32)
    if skew:
        share = (1.0 + torch.arange(E, dtype=torch.float64)) ** -skew
        share = (share / share.sum() * Tk).floor().long()
        share[0] += Tk - int(share.sum())
        counts = share.to(dev, torch.int32)
    topo = dk.Topology.for_experts(counts, Tk, f, bs)
    x = torch.randn(topo.shape[0], d, device=dev).to(dtype)
    dh = torch.randn(*topo.data_shape(), device=dev).to(dtype)
    main_grad = torch.zeros(E * f, d, device=dev)
    dense_grad = torch.zeros(f, d, device=dev)
    gdh = grouped(dh, E, n, bs, f // bs).reshape(Tk, f) if not skew else torch.randn(Tk, f, device=dev).to(dtype)

    def fused():
        dk.ops.dsd(dh, topo, x, transpose=True, out=main_grad, accumulate=True)

    def unfused():
        main_grad.add_(dk.ops.dsd(dh, topo, x, transpose=True))

    def overwrite():
        dk.ops.dsd(dh, topo, x, transpose=True, out=main_grad)

    def dense():
        dense_grad.add_(gdh.t() @ x[:Tk])

    fused()
    once = main_grad.clone()
    main_grad.zero_()
    unfused()
    err = rel_err(once, main_grad)
    main_grad.fill_(float("nan"))
    overwrite()
    err = max(err, rel_err(once, main_grad))
    if err > 1e-2:
        raise SystemExit(f"{name}: fused accumulation differs from the unfused sum or the overwrite "
                         f"(rel err {err:.3g})")
    stash = ([dh] * micro_batches, [topo] * micro_batches, [x] * micro_batches)

    def per_step():
        dk.permute_ops.summed_transposed_products(*stash, main_grad)

    def regroup_only():  # where rows come from, and the gathers, without the product
        _, source_tensor, source_row = dk.permute_ops.regroup_by_expert(stash[1])
        rows = [topo.block_rows] * micro_batches
        dk.permute_ops.gather_block_rows(stash[0], source_tensor, source_row, rows)
        dk.permute_ops.gather_block_rows(stash[2], source_tensor, source_row, rows)

    main_grad.zero_()
    per_step()
    err = max(err, rel_err(once * micro_batches, main_grad))
    if err > 1e-2:
        raise SystemExit(f"{name}: the per-step sum differs from the per-micro-batch sum (rel err {err:.3g})")
    copy_src = torch.empty_like(main_grad)
    ms = {label: do_bench(fn, warmup=10, rep=100, return_mode="median")
          for label, fn in (("fused", fused), ("unfused", unfused), ("overwrite", overwrite), ("dense", dense),
                            ("floor", lambda: main_grad.copy_(copy_src)))}
    ms["per_step_per_micro_batch"] = do_bench(per_step, warmup=3, rep=50, return_mode="median") / micro_batches
    ms["regroup_per_micro_batch"] = do_bench(regroup_only, warmup=3, rep=50, return_mode="median") / micro_batches
    gbytes = main_grad.numel() * 8 / 1e9  # fp32 read + write
    result = {"case": name, "tokens": Tk // k, "load_max_over_mean": float(counts.max()) / (Tk / E),
              "micro_batches": micro_batches, **{f"{k}_ms": v for k, v in ms.items()},
              "main_grad_gb_moved": gbytes,
              "fused_gb_per_s": gbytes / (ms["fused"] * 1e-3), "copy_gb_per_s": gbytes / (ms["floor"] * 1e-3),
              "rel_err": err}
    log(f"  {name} dw1 into fp32 main_grad: fused {ms['fused']:.3f} ms, bf16 + add {ms['unfused']:.3f} ms, "
        f"overwrite {ms['overwrite']:.3f} ms, "
        f"dense-equiv + add {ms['dense']:.3f} ms ({result['fused_gb_per_s']:.0f} GB/s of main_grad traffic fused; "
        f"floor {ms['floor']:.3f} ms at the copy bandwidth, {result['copy_gb_per_s']:.0f} GB/s); "
        f"per step over {micro_batches} micro-batches {ms['per_step_per_micro_batch']:.3f} ms per micro-batch "
        f"(regrouping {ms['regroup_per_micro_batch']:.3f})")
    x = dh = main_grad = dense_grad = gdh = copy_src = stash = None  # free them: the lambdas above hold these names
    torch.cuda.empty_cache()
    return result


def print_table(results, out=sys.stdout):
    print(f"\n{'case':<13} {'product':<8} {'ours':>7} {'best':>7} {'dense':>7} {'bmm':>7} {'ratio':>6} "
          f"{'best/dense':>10} {'bmm/dense':>9}", file=out)
    for res in results:
        for prod, p in res["products"].items():
            ours = p["default"]["tflops"] if p["default"] else float("nan")
            best = p["best"]["tflops"] if p["best"] else float("nan")
            dense, bmm = p["dense_tflops"], p["bmm_tflops"]
            print(f"{res['case']:<13} {prod:<8} {ours:7.1f} {best:7.1f} {dense:7.1f} {bmm:7.1f} {ours / dense:6.3f} "
                  f"{best / dense:10.3f} {bmm / dense:9.3f}", file=out)
        mlp = res.get("mlp", {})
        if "default_tflops" in mlp and "dense_tflops" in mlp:
            label = f"mlp-{mlp['activation']}"
            ours, dense = mlp["default_tflops"], mlp["dense_tflops"]
            best, bmm = mlp.get("best_tflops", float("nan")), mlp.get("bmm_tflops", float("nan"))
            print(f"{res['case']:<13} {label:<8} {ours:7.1f} {best:7.1f} {dense:7.1f} {bmm:7.1f} {ours / dense:6.3f} "
                  f"{best / dense:10.3f} {bmm / dense:9.3f}", file=out)
    print("(TFLOP/s of useful FLOPs; ours = the library's default config; ratio = ours / dense; bmm = cuBLAS's "
          "batched matmul on the same per-expert problems, possible only because balanced routing splits the "
          "tokens evenly; mlp-gelu / mlp-swiglu = the expert MLP's step, 6 / 9 products)", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--block-size", type=int, default=128, choices=[64, 128])
    parser.add_argument("--swiglu", action="store_true",
                        help="count the MLP totals of the cases without their own activation as SwiGLU "
                             "(9 products; deepseek-v2-lite is always SwiGLU)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    parser.add_argument("--sweep", action="store_true", help="also time a few configs per product")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=3, help="alternating timing rounds per product")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the host side of two products")
    parser.add_argument("--tokens", type=int, default=0,
                        help="--wgrad-accumulate: tokens per micro-batch instead of each case's")
    parser.add_argument("--skew", default="0",
                        help="--wgrad-accumulate: comma-separated routing skews S (expert e gets tokens in "
                             "proportion to (1 + e)^-S; 0: every expert T*k/E)")
    parser.add_argument("--wgrad-accumulate", action="store_true",
                        help="instead of the six products: the weight gradient added into an fp32 gradient "
                             "buffer (fused epilogue vs bf16 product + add vs dense-equivalent + add, and "
                             "once per step over --micro-batches regrouped by expert)")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per step for --wgrad-accumulate's per-step time (default 8)")
    args = parser.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    for name in names:
        check_case(name, args.block_size)
    try:
        args.skew_list = [float(v) for v in args.skew.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--skew: {args.skew!r} is not a comma-separated list of numbers") from None
    if any(v < 0 for v in args.skew_list):
        raise SystemExit(f"--skew: {args.skew!r} has a negative skew; use 0 (balanced) or more")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    env = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda, "dtype": args.dtype}
    log(f"environment: {env}")
    results = []
    if args.wgrad_accumulate:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        results = [run_wgrad_accumulate(name, args.block_size, log, dtype, args.micro_batches, args.tokens, skew)
                   for name in names for skew in args.skew_list]
        print(f"\n{'case':<13} {'tokens':>7} {'max/mean':>8} {'fused ms':>9} {'bf16+add':>9} {'overwrite':>9} "
              f"{'dense+add':>10} "
              f"{'floor ms':>9} {'fused GB/s':>11} {'copy GB/s':>10} {'per-step':>9} {'regroup':>8}")
        for r in results:
            print(f"{r['case']:<13} {r['tokens']:7d} {r['load_max_over_mean']:8.2f} {r['fused_ms']:9.3f} "
                  f"{r['unfused_ms']:9.3f} "
                  f"{r['overwrite_ms']:9.3f} {r['dense_ms']:10.3f} "
                  f"{r['floor_ms']:9.3f} {r['fused_gb_per_s']:11.0f} {r['copy_gb_per_s']:10.0f} "
                  f"{r['per_step_per_micro_batch_ms']:9.3f} {r['regroup_per_micro_batch_ms']:8.3f}")
        print("(ms per micro-batch; per-step = the gradient of all micro-batches as one product over their rows "
              "regrouped by expert, divided by their number)")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"environment": env, "wgrad_accumulate": results}, fh, indent=1)
        return
    for name in names:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        results.append(run_case(name, args.block_size, args.sweep, log, dtype, args.repeats, args.profile_host,
                                case_activation(name, args.swiglu)))
        if args.out:  # keep partial results if a later case fails
            with open(args.out, "w") as fh:
                json.dump({"environment": env, "results": results}, fh, indent=1)
    print_table(results)


if __name__ == "__main__":
    main()
