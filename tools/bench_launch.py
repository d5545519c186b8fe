#!/usr/bin/env python
"""What one kernel launch costs the host: torch ops, Triton's `kernel[grid](...)`, and
dmoe_kernels' `direct(kernel)[grid](...)` (the compiled launcher without Triton's per-call argument
binding), with and without TMA descriptors, and one block-sparse product call as the layer makes it.

Each row: host microseconds per call, the mean over --calls back-to-back calls after a warm-up
(the GPU work is tiny and asynchronous, so this is the time to issue, not to run). Prints a table;
--out writes it as JSON.

  python tools/bench_launch.py --out launch.json
  python tools/bench_launch.py --device cpu --calls 20      # Triton's interpreter: a smoke test only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu through Triton's interpreter (numbers meaningless)")
    p.add_argument("--calls", type=int, default=3000, help="timed calls per row (default 3000)")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    return p.parse_args(argv)


def host_us(fn, calls: int, sync) -> float:
    for _ in range(min(20, calls)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def rows(device_name: str, calls: int):
    global tl  # the kernels below are compiled against this module's globals, not rows()'s locals
    import torch
    import triton
    import triton.language as tl

    from dmoe_kernels import Topology, ops
    from dmoe_kernels.launch import direct, tma_descriptor

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    @triton.jit
    def copy_tile(a_desc, b_desc, c_desc, BLOCK: tl.constexpr):
        c_desc.store([0, 0], a_desc.load([0, 0]) + b_desc.load([0, 0]))

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.zeros(1024, device=device)
    out = [
        ("torch x.add_(1), 1024 floats", host_us(lambda: x.add_(1), calls, sync)),
        ("Triton kernel, 3 arguments: kernel[grid]", host_us(lambda: add_one[(1,)](x, 1024, BLOCK=1024), calls, sync)),
        ("the same: direct(kernel)[grid]",
         host_us(lambda: direct(add_one)[(1,)](x, 1024, BLOCK=1024), calls, sync)),
    ]
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    if hopper:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
        c = torch.empty_like(a)

        def triton_descriptor(t):
            return TensorDescriptor(t, list(t.shape), list(t.stride()), [64, 64])

        out += [
            ("TensorDescriptor(...), Triton's constructor", host_us(lambda: triton_descriptor(a), calls, sync)),
            ("tma_descriptor(...), dmoe_kernels.launch", host_us(lambda: tma_descriptor(a, [64, 64]), calls, sync)),
            ("TMA kernel, 3 descriptors built per call: kernel[grid]", host_us(
                lambda: copy_tile[(1,)](triton_descriptor(a), triton_descriptor(a), triton_descriptor(c), BLOCK=64),
                calls, sync)),
            ("the same: direct(kernel)[grid] with tma_descriptor", host_us(
                lambda: direct(copy_tile)[(1,)](tma_descriptor(a, [64, 64]), tma_descriptor(a, [64, 64]),
                                                tma_descriptor(c, [64, 64]), BLOCK=64), calls, sync)),
        ]
    # one up-projection of a small dMoE layer as the sparse experts call it: checks, config,
    # descriptors and the launch (16 experts of width 256, 2048 routed rows; tiny on the interpreter)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    experts, width, hidden, rows_, block = (16, 256, 256, 2048, 128) if cuda else (2, 16, 16, 32, 16)
    counts = torch.full((experts,), rows_ // experts, device=device)
    topo = Topology.for_experts(counts, rows_, width, block)
    xs = torch.randn(topo.shape[0], hidden, device=device, dtype=dtype)
    w = torch.randn(experts * width, hidden, device=device, dtype=dtype)
    out.append(("ops.sdd(x, w.t(), topology): one product call",
                host_us(lambda: ops.sdd(xs, w.t(), topo), max(1, calls // 10), sync)))
    if cuda:
        out += _product_parts(lambda: ops.sdd(xs, w.t(), topo), max(1, calls // 10), sync)
    return out


def _product_parts(call, calls: int, sync):
    """The parts of one product call's host time: the launcher's argument binding alone, and
    Triton's compiled launcher alone (its driver's Python, the TMA descriptors' encoding and the
    driver's launch) on the arguments the call bound."""
    import torch

    from dmoe_kernels.launch import DirectLauncher

    seen = {}
    launch = DirectLauncher._launch

    def spy(self, grid, *args, **kwargs):
        seen.update(launcher=self, grid=grid, args=args, kwargs=kwargs)
        return launch(self, grid, *args, **kwargs)

    DirectLauncher._launch = spy
    try:
        call()
    finally:
        DirectLauncher._launch = launch
    if not seen:
        return []
    launcher, grid, args, kwargs = seen["launcher"], seen["grid"], seen["args"], seen["kwargs"]
    values, key = launcher.bind(args, kwargs)
    device = torch.cuda.current_device()
    run, function, metadata = launcher._compiled[(device, key)]
    stream = torch.cuda.current_stream().cuda_stream
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return [
        ("  of which the launcher's binding (bind)", host_us(lambda: launcher.bind(args, kwargs), calls, sync)),
        ("  of which Triton's compiled launcher (run)",
         host_us(lambda: run(*grid, stream, function, metadata, None, None, None, *values), calls, sync)),
    ]


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_launch: --device cuda needs a CUDA GPU; use --device cpu for a smoke test")
    table = rows(args.device, args.calls)
    import triton

    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "calls": args.calls}
    width = max(len(name) for name, _ in table)
    print(f"host microseconds per call ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})")
    for name, us in table:
        print(f"{name:<{width}}  {us:8.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": [{"call": n, "host_us": us} for n, us in table]}, fh, indent=1)
    return table


if __name__ == "__main__":
    main()
