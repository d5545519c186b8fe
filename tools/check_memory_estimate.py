#!/usr/bin/env python
"""The start-up memory estimate (megatron_dmoe/training/memory_estimate.py) against measured peaks.

For each case (the zoo's Small models as shipped, and the dMoE Small with every layer MoE at
micro-batch 16) and mode (eager, and with the layers captured as CUDA graphs), a process of its own
builds the model, optimizer and DDP wrapper as dmoe-train does (tools/bench_train.py's machinery:
synthetic tokens of the config's vocabulary), trains --steps optimizer steps of --micro-batches
micro-batches each, and reports torch.cuda.max_memory_allocated against the estimate (the number
of micro-batches per step does not change the peak without pipeline parallelism). Then it checks
that dmoe-train refuses the all-MoE Small at micro-batch 32 on this GPU before any work (exit
status 2, the memory line, within --refusal-timeout seconds).

Prints a table (estimate, measured peak, their ratio, the static part measured after the last step,
max_memory_reserved) and writes JSON (--out). Exit status 1 when a ratio is off by more than
--tolerance or the refusal did not happen, else 0.

  python tools/check_memory_estimate.py --out memory_check.json           # one GPU
  python tools/check_memory_estimate.py --device cpu --tiny --out t.json  # the code paths on a CPU

On a CPU (--device cpu) nothing is measured: the tiny case (--tiny) runs through the same steps and
the refusal is checked against --assume-gib of GPU memory with the same function dmoe-train calls.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_train, beside this file

ALL_MOE = "moe.first_dense_layers=0"
CASES = {
    "dense_small": ("zoo/dense_small", []),
    "dmoe_small": ("zoo/dmoe_small", []),
    "capacity1.0_small": ("zoo/capacity1.0_small", []),
    "dmoe_small_all_moe_mb16": ("zoo/dmoe_small", [ALL_MOE, "training.micro_batch_size=16"]),
}
TINY = ("tiny", ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                 "model.seq_length=64", "moe.num_experts=4", "moe.top_k=2", "moe.ffn_hidden_size=128",
                 "training.micro_batch_size=4"])
REFUSED = ("zoo/dmoe_small", [ALL_MOE, "training.micro_batch_size=32"])  # must not start on 80 GB
MODES = ("eager", "graphs")
GIB = 2**30
H100_80GB_BYTES = 85_031_714_816  # torch.cuda.get_device_properties(...).total_memory of an H100 80GB HBM3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="write the rows and the refusal check as JSON to this file")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated names from {sorted(CASES)}")
    p.add_argument("--modes", default=",".join(MODES), help="eager, graphs (training.cuda_graphs: true) or both")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per case (default 3)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per step (default 2; the global batch becomes this many micro-batches)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="one tiny dMoE case instead of the zoo's (for a CPU)")
    p.add_argument("--tolerance", type=float, default=0.10, help="largest |estimate / measured - 1| (default 0.10)")
    p.add_argument("--assume-gib", type=float, default=H100_80GB_BYTES / GIB,
                   help="GPU memory the refusal is checked against on a CPU (default an H100 80GB's)")
    p.add_argument("--refusal-timeout", type=float, default=300.0,
                   help="seconds dmoe-train may take to refuse the all-MoE Small at micro-batch 32")
    p.add_argument("--no-refusal", action="store_true", help="skip the refusal check")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # CASE:MODE, measured in this process
    args = p.parse_args(argv)
    args.cases = ["tiny"] if args.tiny else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES and c != "tiny"]
    if unknown:
        p.error(f"--cases {','.join(unknown)}: use names from {sorted(CASES)}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in args.modes):
        p.error(f"--modes {','.join(args.modes)}: use eager, graphs or both")
    if args.device == "cpu":
        args.modes = ["eager"]  # nothing is captured on a CPU
    return args


def case_config(case: str, mode: str, args):
    """The resolved config of one case and mode (validated: raises ConfigError)."""
    from megatron_dmoe.config import load_config, resolve, validate

    config, overrides = TINY if case == "tiny" else CASES[case]
    cfg = resolve(load_config(config, [*overrides, f"training.device={args.device}"]))
    mbs = cfg.training.micro_batch_size
    extra = [f"training.global_batch_size={mbs * args.micro_batches}", "training.lr_warmup_iters=0",
             f"training.cuda_graphs={'true' if mode == 'graphs' else 'false'}"]
    if args.device == "cpu":
        extra += ["training.bf16=false"]
    cfg = resolve(load_config(config, [*overrides, f"training.device={args.device}", *extra]))
    validate(cfg, world_size=1)
    return cfg


def vocab_of(cfg) -> int:
    """The synthetic tokens' vocabulary: the config's tokenizer's, as bench_train --zoo takes it."""
    from megatron_dmoe.training.memory_estimate import known_vocab_size

    return known_vocab_size(cfg) or cfg.data.builtin_vocab_size


def measure(case: str, mode: str, args) -> dict:
    """Build and train one case in this process; the row with the estimate and what was measured."""
    import torch

    from bench_train import synthetic_batches
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.moe import MoERunState
    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed, seed_everything
    from megatron_dmoe.training.memory_estimate import estimate_memory
    from megatron_dmoe.training.optim import build_optimizer
    from megatron_dmoe.training.setup import wrap_for_training
    from megatron_dmoe.training.step import train_step

    cfg = case_config(case, mode, args)
    env = init_distributed(cfg.training.device)
    on_cuda = env.on_cuda
    vocab = vocab_of(cfg)
    est = estimate_memory(cfg, vocab, env.world_size, on_cuda=on_cuda)
    row = {"case": case, "mode": mode, "estimate": est.__dict__ | {"total": est.total},
           "estimate_line": est.line(), "micro_batch_size": cfg.training.micro_batch_size,
           "vocab_size": vocab}
    cuda = torch.cuda if on_cuda else None
    try:
        seed_everything(cfg.training.seed, env, cuda_graphs=cfg.training.cuda_graphs)
        run_state = MoERunState()
        run_state.metrics.megatron_tracker = False
        model = build_gpt_model(cfg, vocab_size=vocab, on_cuda=on_cuda, run_state=run_state)
        row["parameters_built"] = sum(p.numel() for p in model.parameters())
        after_model = cuda.memory_allocated() if cuda else None
        model = wrap_for_training(model)
        after_wrap = cuda.memory_allocated() if cuda else None
        optimizer = build_optimizer(cfg, [model], on_cuda)
        after_optimizer = cuda.memory_allocated() if cuda else None
        data = synthetic_batches(cfg, vocab, env.device)
        peaks = []
        for _ in range(args.steps):
            if cuda:
                cuda.reset_peak_memory_stats()
            loss, _, _ = train_step(model, optimizer, data, args.micro_batches, env.device, run_state)
            if cuda:
                cuda.synchronize()
                peaks.append(cuda.max_memory_allocated())
        row["loss"] = float(loss)
        if cuda:
            row.update(
                allocated_after_model=after_model, allocated_after_wrap=after_wrap,
                allocated_after_optimizer=after_optimizer, allocated_after_steps=cuda.memory_allocated(),
                peak_per_step=peaks, peak=max(peaks), reserved_peak=cuda.max_memory_reserved(),
                device=torch.cuda.get_device_name(),
                device_bytes=torch.cuda.get_device_properties(env.device).total_memory,
            )
    finally:
        if cfg.training.cuda_graphs is True and on_cuda:
            from megatron_dmoe.training.cuda_graphs import release_layer_graphs

            release_layer_graphs()
        destroy_distributed()
    return row


def run_child(case: str, mode: str, args, argv) -> dict:
    """measure() in a fresh process: one case cannot crowd the next, and running out of memory is a row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, os.path.abspath(__file__), *argv, "--child", f"{case}:{mode}", "--out", out]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    tail = done.stdout[-3000:]
    row = {"case": case, "mode": mode, "error": f"exit status {done.returncode}: {tail}"}
    if "out of memory" in done.stdout:
        row["oom"] = True
    print(tail, flush=True)
    return row


def check_refusal(args) -> dict:
    """dmoe-train on the all-MoE Small at micro-batch 32: refused before any work? On a CPU, the
    same check dmoe-train makes, against --assume-gib of GPU memory."""
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.training.memory_estimate import MemoryCheckError, check_memory

    config, overrides = REFUSED
    if args.device == "cpu":
        cfg = resolve(load_config(config, overrides))
        try:
            line = check_memory(cfg, vocab_of(cfg), 1, int(args.assume_gib * GIB))
            return {"refused": False, "output": line}
        except MemoryCheckError as err:
            return {"refused": True, "output": str(err), "returncode": 2, "seconds": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "megatron_dmoe", config, *overrides, "training.train_iters=1",
                   "training.eval_interval=0", "checkpoint.save_interval=0", "logging.plot=false",
                   "logging.tensorboard=false", "--run-dir", os.path.join(tmp, "run")]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.refusal_timeout)
        except subprocess.TimeoutExpired:
            return {"refused": False, "output": f"still running after {args.refusal_timeout:.0f} s: not refused"}
        seconds = time.perf_counter() - start
        refused = done.returncode == 2 and "training.memory_check" in done.stderr
        built = "model:" in done.stdout  # the model line comes after the check
        return {"refused": refused and not built, "returncode": done.returncode, "seconds": seconds,
                "output": (done.stdout[-1500:] + done.stderr[-1500:]).strip()}


def ratio(row: dict):
    if "peak" not in row:
        return None
    return row["estimate"]["total"] / row["peak"]


def print_table(rows: list) -> None:
    header = (f"{'case':26s} {'mode':7s} {'params':>8s} {'estimate':>9s} {'measured':>9s} {'ratio':>6s} "
              f"{'static est':>10s} {'static':>7s} {'reserved':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        head = f"{r['case']:26s} {r['mode']:7s}"
        if "error" in r:
            print(f"{head} failed{' (out of memory)' if r.get('oom') else ''}: see the output above")
            continue
        est = r["estimate"]
        static = est["weights"] + est["grads"] + est["optimizer"]
        params = f"{r['parameters_built'] / 1e6:7.0f}M"
        if "peak" not in r:
            print(f"{head} {params} {est['total'] / GIB:9.2f} {'n/a':>9s} (no CUDA: nothing measured)")
            continue
        print(f"{head} {params} {est['total'] / GIB:9.2f} {r['peak'] / GIB:9.2f} {ratio(r):6.3f} "
              f"{static / GIB:10.2f} {r['allocated_after_steps'] / GIB:7.2f} {r['reserved_peak'] / GIB:9.2f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        case, mode = args.child.split(":")
        row = measure(case, mode, args)
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("check_memory_estimate: --device cuda but no CUDA GPU is visible; use --device cpu --tiny")
    rows = []
    for case in args.cases:
        for mode in args.modes:
            print(f"check_memory_estimate: {case} ({mode})", flush=True)
            rows.append(run_child(case, mode, args, _without_out(argv)))
            with open(args.out, "w") as f:  # what is measured so far, should a later case hang
                json.dump({"rows": rows}, f, indent=2)
    print_table(rows)
    failures = [f"{r['case']} ({r['mode']}): {'failed' if 'error' in r else f'ratio {ratio(r):.3f}'}"
                for r in rows if "error" in r or (ratio(r) is not None and abs(ratio(r) - 1) > args.tolerance)]
    refusal = None
    if not args.no_refusal:
        refusal = check_refusal(args)
        what = "refused before any work" if refusal["refused"] else "NOT refused"
        last = refusal["output"].splitlines()[-1] if refusal["output"] else ""
        print(f"all-MoE Small at micro-batch 32: {what}: {last}")
        if not refusal["refused"]:
            failures.append("the all-MoE Small at micro-batch 32 was not refused")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "refusal": refusal, "tolerance": args.tolerance, "failures": failures}, f, indent=2)
    if failures:
        print("check_memory_estimate: " + "; ".join(failures))
        return 1
    return 0


def _without_out(argv: list) -> list:
    """argv without --out PATH / --out=PATH (each child gets its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
