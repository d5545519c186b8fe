"""Time the GELU expert MLP's forward activation fused into the product against a separate pass.

For each GELU case of the benchmark table (balanced routing), on the dMoE topology: the product
alone (sdd); separate, sdd (h) + activation_forward (gelu(h)); fused, ops.sdd_gelu, with the
persistent kernel's tile and K loops fused (the default) and apart. Beside them the backward's
separate passes (sdd for da, then activation_backward_weighted) and the weight gradient of w2 with
the activation kept, and with it recomputed (memory-optimised mode), for scale. (Fusing those two
into products measured slower: docs/kernels.md, "Fused epilogues".)

Times: triton.testing.do_bench, median, bf16. A table on stdout, JSON with --out.

  python tools/bench_epilogues.py [--cases paper-small,mixtral] [--out epilogues.json]
  python tools/bench_epilogues.py --configs 2:64:4:8:1,1:64:3:4:2   # SDD configs for the GELU forward
  python tools/bench_epilogues.py --toy   # tiny cases on CPU (Triton's interpreter): a test of this program
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

import dmoe_kernels as dk
from bench_moe import CASES, TOY_CASES, case_activation, time_ms
from dmoe_kernels import SddConfig, activation as act, ops
from dmoe_kernels.products.tuning import sdd_config


def _case(name, toy):
    T, d, f, E, k = (TOY_CASES if toy else CASES)[name]
    dev = torch.device("cpu" if toy else "cuda")
    bf = torch.float32 if toy else torch.bfloat16  # the interpreter's bf16 products are wrong
    counts = torch.full((E,), T * k // E, device=dev)
    topo = dk.Topology.for_experts(counts, T * k, f, 16 if toy else 128)
    rows = topo.shape[0]
    x = torch.randn(rows, d, device=dev, dtype=bf)
    dy = torch.randn(rows, d, device=dev, dtype=bf)
    w1 = (torch.randn(E * f, d, device=dev) * d ** -0.5).to(bf)
    w2 = (torch.randn(E * f, d, device=dev) * d ** -0.5).to(bf)
    row_w = torch.rand(rows, device=dev)
    return topo, x, dy, w1, w2, row_w


def measure(name, rep_ms, toy=False):
    topo, x, dy, w1, w2, row_w = _case(name, toy)
    h, a = ops.sdd_gelu(x, w1.t(), topo)
    unflat = replace(sdd_config(topo.block_size, topo.blocks_per_row, x.shape[1], x.device, x.dtype), flatten=False)

    def t(fn):
        return time_ms(fn, [], x.device, rep_ms) * 1e3  # us

    def bwd_separate():
        da = ops.sdd(dy, w2.t(), topo)
        act.activation_backward_weighted("gelu", da, h, None, row_w, topo)

    row = {
        "case": name,
        "fwd_sdd_us": t(lambda: ops.sdd(x, w1.t(), topo)),
        "fwd_act_us": t(lambda: act.activation_forward("gelu", h, None, topo.nnz)),
        "fwd_fused_us": t(lambda: ops.sdd_gelu(x, w1.t(), topo)),
        "bwd_separate_us": t(bwd_separate),
        # tile and K loops left apart (the epilogue outside the pipeline)
        "fwd_fused_unflattened_us": t(lambda: ops.sdd_gelu(x, w1.t(), topo, config=unflat)),
        "dw2_kept_us": t(lambda: ops.dsd(a, topo, dy, transpose=True)),
    }
    row["fwd_separate_us"] = row["fwd_sdd_us"] + row["fwd_act_us"]
    row["dw2_recompute_us"] = row["fwd_act_us"] + row["dw2_kept_us"]
    return row


def parse_config(text: str):
    """'NB:BLOCK_K:STAGES:WARPS:PROGRAMS_PER_SM' (a persistent SDD config) -> SddConfig."""
    nb, bk, stages, warps, per_sm = (int(v) for v in text.split(":"))
    return SddConfig(blocks_per_program=nb, block_k=bk, num_stages=stages, num_warps=warps,
                     programs_per_sm=per_sm, persistent=True)


def sweep(name, configs, rep_ms, toy=False):
    """us per call of sdd_gelu and of the plain sdd under each config, each result checked against
    the default config's (same values within the change of summation order); None where a config
    does not compile on this GPU (shared memory, registers)."""
    from triton.runtime.errors import OutOfResources

    topo, x, _, w1, _, _ = _case(name, toy)
    nnz = int(topo.nnz)
    h_ref, a_ref = ops.sdd_gelu(x, w1.t(), topo)
    rows = []
    for text in configs:
        cfg = parse_config(text)
        row = {"case": name, "config": text}
        try:
            h, a = ops.sdd_gelu(x, w1.t(), topo, config=cfg)
        except OutOfResources as err:
            rows.append({**row, "fused_us": None, "sdd_us": None, "error": str(err)[:120]})
            continue
        for got, ref in ((h, h_ref), (a, a_ref)):
            err = float((got[:nnz].float() - ref[:nnz].float()).norm() / ref[:nnz].float().norm())
            if err > 1e-2:
                raise SystemExit(f"bench_epilogues: config {text} on {name}: relative error {err:.1e}")
        row["fused_us"] = time_ms(lambda: ops.sdd_gelu(x, w1.t(), topo, config=cfg), [], x.device, rep_ms) * 1e3
        row["sdd_us"] = time_ms(lambda: ops.sdd(x, w1.t(), topo, config=cfg), [], x.device, rep_ms) * 1e3
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="paper-small,paper-medium,mixtral",
                        help="comma-separated GELU cases of tools/bench_moe.py")
    parser.add_argument("--rep-ms", type=float, default=100, help="do_bench repetition time per measurement")
    parser.add_argument("--toy", action="store_true",
                        help="the tiny GELU cases on CPU through Triton's interpreter (fp32; a test of this program)")
    parser.add_argument("--configs", default=None, metavar="NB:BK:STAGES:WARPS:PER_SM,...",
                        help="also time sdd_gelu and sdd under these persistent SDD configs (blocks per tile, K "
                             "step, pipeline stages, warps, programs per multiprocessor), e.g. 2:64:4:8:1,1:64:3:4:2")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    configs = [c for c in (args.configs or "").split(",") if c]
    for text in configs:
        try:
            parse_config(text)
        except ValueError:
            parser.error(f"--configs: {text!r} is not NB:BLOCK_K:STAGES:WARPS:PROGRAMS_PER_SM (five whole numbers)")
    table = TOY_CASES if args.toy else CASES
    names = [n for n in table if case_activation(n, False) == "gelu"] if args.toy else args.cases.split(",")
    for n in names:
        if n not in table or case_activation(n, False) != "gelu":
            parser.error(f"--cases: {n!r} is not a GELU case of {sorted(table)}")
    if not args.toy and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --toy on CPU under TRITON_INTERPRET=1)")
    rows = [measure(n, args.rep_ms, args.toy) for n in names]
    cols = ["fwd_sdd_us", "fwd_separate_us", "fwd_fused_us", "fwd_fused_unflattened_us", "bwd_separate_us",
            "dw2_kept_us", "dw2_recompute_us"]
    print("| case | " + " | ".join(c[:-3] + " us" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['case']} | " + " | ".join(f"{r[c]:.0f}" for c in cols) + " |")
    swept = [r for n in names for r in sweep(n, configs, args.rep_ms, args.toy)] if configs else []
    if swept:
        print("\n| case | config NB:BK:STAGES:WARPS:PER_SM | sdd_gelu us | sdd us |\n|---|---|---|---|")
        for r in swept:
            fused, plain = ("n/a" if r[k] is None else f"{r[k]:.0f}" for k in ("fused_us", "sdd_us"))
            print(f"| {r['case']} | {r['config']} | {fused} | {plain} |")
    if args.out:
        with open(args.out, "w") as fh:
            device = "cpu (interpreter)" if args.toy else torch.cuda.get_device_name()
            json.dump({"rows": rows, "configs": swept, "torch": torch.__version__, "device": device}, fh, indent=1)


if __name__ == "__main__":
    main()
