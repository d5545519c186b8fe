#!/usr/bin/env python
"""What the compiled launch route would cost the host: a forward and a backward issuing Triton
kernels, as the sparse layer's autograd function issues them today and as torch.library triton ops
under torch.compile (inductor's Python wrapper, then its C++ wrapper); and whether the layer's own
product call traces.

The chain stands in for the layer: the forward launches --forward-launches kernels, the backward
--backward-launches (31 in all by default, the sparse layer's count), each into a fresh buffer, on a
tiny tensor (so the time is the host's: issuing, not running). Each route is timed for the full
chain and for one launch each way; their difference over the extra launches is the cost of one
more launch, the rest the region's fixed cost (the autograd node, the compiled graph's wrappers).

  python tools/bench_compiled_launch.py --out compiled_launch.json

Rows, host microseconds per forward + backward (mean over --calls after a warm-up):
  eager autograd.Function, direct launches   today's path: dmoe_kernels' `direct` launcher
  eager triton ops (dispatcher)              the same kernels registered with torch.library
  compiled, Python wrapper / C++ wrapper     torch.compile of the registered ops (inductor)
Then the layer's up-projection itself, as called today and compiled (see product_routes), the
whole sparse layer of a bench_moe case compiled (see layer_routes), and that layer's forward alone
under each wrapper beside the dense chain's forward (see forward_routes).
C++ wrapper compiles build their kernels in a first Python pass (inductor's compile-time tuning
block writes C++ expressions into Python for TMA descriptors) and narrow torch's TMA boxes to
Triton's 128-byte span (see narrow_cpp_tma_boxes); the whole layer's graphs are each built at
their first call (see cpp_backend).
CUDA only: inductor runs user Triton kernels on CUDA devices.
"""

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="timed forward + backward calls per row (default 2000)")
    p.add_argument("--forward-launches", type=int, default=12, help="kernels the forward issues (default 12)")
    p.add_argument("--backward-launches", type=int, default=19, help="kernels the backward issues (default 19)")
    p.add_argument("--no-cpp-wrapper", action="store_true",
                   help="skip inductor's C++ wrapper (it compiles C++ on first use: tens of seconds)")
    p.add_argument("--layer-cases", default="paper-small-ep8",
                   help="bench_moe cases whose sparse layer is also run compiled (comma-separated; '' for none)")
    p.add_argument("--forward-cases", default="paper-small-ep8,paper-medium-ep8",
                   help="bench_moe cases whose sparse layer's forward alone is timed eagerly and under each "
                        "wrapper beside the dense chain's forward ('' for none; default %(default)s)")
    p.add_argument("--static-user-launch", action="store_true",
                   help="let inductor launch our Triton kernels through its static launcher "
                        "(torch._inductor.config.static_launch_user_defined_triton_kernels; TMA kernels excepted)")
    p.add_argument("--layer-profile", action="store_true", help="print a cProfile of the compiled layer's host side")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    return p.parse_args(argv)


def host_us(fn, calls: int) -> float:
    """bench_launch's host time per call (mean after a warm-up), synchronising CUDA around it."""
    import torch

    import bench_launch

    return bench_launch.host_us(fn, calls, torch.cuda.synchronize)


def build_routes(fwd: int, bwd: int):
    """{route name: f(x) -> y with autograd}, each issuing fwd kernels forward and bwd backward.
    The ops are registered under a namespace of their own per (fwd, bwd), so both sizes coexist."""
    import torch
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    from dmoe_kernels.launch import direct

    globals()["tl"] = tl  # the kernel below is compiled against this module's globals

    @triton.jit
    def plus_one(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n) + 1, mask=i < n)

    def chain(x, launches, launcher):
        """launches kernels in a row, each into a fresh buffer, through launcher(kernel)[grid]."""
        for _ in range(launches):
            y = torch.empty_like(x)
            launcher(plus_one)[(1,)](x, y, x.numel(), BLOCK=1024)
            x = y
        return x

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return chain(x, fwd, direct)

        @staticmethod
        def backward(ctx, g):
            return chain(g, bwd, direct)

    ns = f"dmoe_bench_{fwd}_{bwd}"

    @triton_op(f"{ns}::backward", mutates_args={})
    def chain_backward(g: torch.Tensor) -> torch.Tensor:
        return chain(g, bwd, wrap_triton)

    @triton_op(f"{ns}::forward", mutates_args={})
    def chain_forward(x: torch.Tensor) -> torch.Tensor:
        return chain(x, fwd, wrap_triton)

    chain_forward.register_autograd(lambda ctx, g: chain_backward(g), setup_context=lambda ctx, inputs, output: None)
    return {"eager": Eager.apply, "ops": chain_forward}


def timed_route(f, calls: int):
    """(host us per forward + backward, seconds of the first call: tracing and compiling)."""
    import torch

    x = torch.zeros(1024, device="cuda", requires_grad=True)
    g = torch.ones(1024, device="cuda")

    def step():
        torch.autograd.grad(f(x), x, g)

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    return host_us(step, calls), first


def product_routes(calls: int):
    """The layer's up-projection (ops.sdd_gelu, the persistent TMA kernel with its GELU epilogue)
    eagerly, and compiled in one graph (its launches become wrap_triton's while dynamo traces,
    dmoe_kernels.launch.direct): dynamo's graph breaks, equal outputs, host us per call."""
    import torch

    from dmoe_kernels import Topology, ops

    experts, width, hidden, rows = 8, 256, 256, 2048
    topo = Topology.for_experts(torch.full((experts,), rows // experts, device="cuda"), rows, width, 128)
    xs = torch.randn(topo.shape[0], hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts * width, hidden, device="cuda", dtype=torch.bfloat16)

    def call(a, b):
        return ops.sdd_gelu(a, b.t(), topo)

    out = {"eager_host_us": host_us(lambda: call(xs, w), calls)}
    try:
        explained = torch._dynamo.explain(call)(xs, w)
        reasons = [" | ".join(str(getattr(r, "reason", r)).splitlines()[:4])[:600] for r in explained.break_reasons]
        out.update(graph_breaks=explained.graph_break_count, reasons=reasons[:6],
                   first_reason=reasons[0] if reasons else None)
    except Exception as exc:  # a tracing error is the answer too
        out.update(graph_breaks=None, first_reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(call, fullgraph=True, dynamic=False)
        got, want = compiled(xs, w), call(xs, w)
        out["compiled_max_abs_diff"] = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, want))
        out["compiled_host_us"] = host_us(lambda: compiled(xs, w), calls)
    except Exception as exc:
        out["compiled_error"] = _error_text(exc)
    return out


def layer_routes(case_name: str, cpp_wrapper: bool = False, profile: bool = False):
    """The sparse MoE layer of a bench_moe case (forward + backward, bf16) eagerly and under
    torch.compile: dynamo's graph breaks, agreement, and host ms per step beside the dense chain's."""
    import torch

    import bench_moe as bm

    case, device = bm.CASES[case_name], torch.device("cuda")
    out = {"case": case_name, "cpp_wrapper": cpp_wrapper}
    step, params, inputs, layer, x = bm.moe_step(case, "sparse", False, 0.0, torch.bfloat16, device, 128)
    dense, dense_params, dense_inputs = bm.dense_step(case, False, torch.bfloat16, device)
    grads = params + inputs
    out["eager_ms"] = bm.time_ms(step, grads, device, 100)
    dy = torch.randn_like(x)

    def run(module):
        bm.clear_grads(grads)
        y, _ = module(x)
        y.backward(dy)
        return [y.detach().float()] + [t.grad.float() for t in grads]

    try:
        explained = torch._dynamo.explain(layer)(x)
        out["graph_breaks"] = explained.graph_break_count
        out["graphs"] = explained.graph_count
        out["reasons"] = [" | ".join(str(getattr(r, "reason", r)).splitlines()[:3])[:400]
                          for r in explained.break_reasons[:6]]
        torch._dynamo.reset()
        compiled = torch.compile(layer, dynamic=False, backend=cpp_backend()) if cpp_wrapper else \
            torch.compile(layer, dynamic=False)
        want, got = run(layer), run(compiled)
        out["max_rel_diff"] = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-12))
                                  for g, w in zip(got, want))

        def compiled_step():
            y, _ = compiled(x)
            y.backward(dy)

        routes = {"dense": (dense, dense_params + dense_inputs), "eager": (step, grads),
                  "compiled": (compiled_step, grads)}
        for _ in range(3):  # interleaved: the host's speed drifts within a call
            for name, (fn, tensors) in routes.items():
                out.setdefault(f"{name}_host_ms_runs", []).append(bm.host_ms(fn, tensors, device))
        for name in routes:
            out[f"{name}_host_ms"] = statistics.median(out[f"{name}_host_ms_runs"])
        out["compiled_ms"] = bm.time_ms(compiled_step, grads, device, 100)
        out["compiled_launches"] = bm.kernel_launches(compiled_step, grads)
        out["eager_launches"] = bm.kernel_launches(step, grads)
        if profile:
            out["compiled_profile"] = bm.profile_host(compiled_step, calls=20, top=30,
                                                      before=lambda: bm.clear_grads(grads))
    except Exception as exc:
        out["compiled_error"] = _error_text(exc)
        out["dense_host_ms"] = bm.host_ms(dense, dense_params + dense_inputs, device)
        out["eager_host_ms"] = bm.host_ms(step, grads, device)
    return out


def cpp_backend():
    """A torch.compile backend that builds each AOTAutograd graph (forward, backward) with
    inductor's C++ wrapper at that graph's first call, under the wrapper's own config. Through the
    default backend torch 2.11 compiles the backward later, outside that config (no cubins stored),
    and stops at `CudaKernelParamCache not populated` for our kernels; at the first call the
    two-pass build also runs on the real inputs rather than on made-up ones."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx_inner, get_cpp_wrapper_config
    from torch._inductor.decomposition import select_decomp_table

    def at_first_call(is_backward: bool):
        def compiler(gm, example_inputs):
            built = []

            def run(args):
                if not built:
                    with torch._inductor.config.patch({**get_cpp_wrapper_config(), **CPP_OPTIONS}):
                        built.append(compile_fx_inner(gm, list(args), is_backward=is_backward, cpp_wrapper=True))
                return built[0](list(args))

            run._boxed_call = True  # AOTAutograd passes one list of arguments
            return run

        return compiler

    return aot_autograd(fw_compiler=at_first_call(False), bw_compiler=at_first_call(True),
                        decompositions=select_decomp_table())


CPP_OPTIONS = {"cpp_wrapper": True, "triton.autotune_at_compile_time": False}


def narrow_cpp_tma_boxes() -> None:
    """Make inductor's C++ wrapper encode TMA descriptors as Triton's own launcher does. Its helper
    (torch 2.11-2.13, `initTMADescriptor`) encodes the kernel's whole block as the copy box, and
    the driver refuses a box wider than the 128-byte swizzle span (`CUDA driver error: invalid
    argument` for our 128 x 128 bf16 blocks); Triton narrows the box to 128 bytes and its kernels
    issue one copy per span. A measurement's workaround, applied once, only to this process."""
    from torch._inductor.codegen.cuda import device_op_overrides as ops_overrides

    cls = ops_overrides.CUDADeviceOpOverrides
    if getattr(cls, "_narrowed_tma_boxes", False):
        return
    helpers = cls.tma_descriptor_helpers

    def narrowed(self):
        text = helpers(self)
        encode = text.rindex("CUDA_DRIVER_CHECK(cuTensorMapEncodeTiled(", 0,
                             text.index("shapeInt, stridesLL, blockSizeInt"))
        clamp = "if (rank > 1 && contigDimSizeInByte > 128) { blockSizeInt[0] = 128 / elemSize; }\n"
        return text[:encode] + clamp + text[encode:]

    cls.tma_descriptor_helpers = narrowed
    cls._narrowed_tma_boxes = True


def forward_routes(case_name: str, calls: int = 200):
    """The sparse layer's forward alone (no grad, so no backward graph) eagerly, compiled with
    each wrapper, and the dense chain's forward (matmul, GELU, matmul on T*k rows): host ms
    (median of `calls`), step ms and the compiled outputs' difference from the eager one."""
    import torch
    import torch.nn.functional as F

    import bench_moe as bm

    case, device = bm.CASES[case_name], torch.device("cuda")
    T, d, f, E, k = case
    _, _, _, layer, x = bm.moe_step(case, "sparse", False, 0.0, torch.bfloat16, device, 128)
    x = x.detach()
    g = torch.Generator(device=device).manual_seed(0)
    xd = torch.randn(T * k, d, generator=g, device=device, dtype=torch.bfloat16)
    w_in = 0.02 * torch.randn(d, f, generator=g, device=device, dtype=torch.bfloat16)
    w_out = 0.02 * torch.randn(f, d, generator=g, device=device, dtype=torch.bfloat16)

    def host_ms(fn):
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(times)

    out = {"case": case_name}
    with torch.no_grad():
        def eager():
            return layer(x)[0]

        want = eager().float()
        out["dense_host_ms"] = host_ms(lambda: F.gelu(xd @ w_in) @ w_out)
        out["eager_host_ms"] = host_ms(eager)
        out["eager_ms"] = bm.time_ms(eager, [], device, 100)
        for key, options in (("python", {}), ("cpp", CPP_OPTIONS)):
            torch._dynamo.reset()
            try:
                compiled = torch.compile(eager, dynamic=False, options=options)
                got = compiled().float()
                out[f"{key}_max_rel_diff"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
                out[f"{key}_host_ms"] = host_ms(compiled)
                out[f"{key}_ms"] = bm.time_ms(compiled, [], device, 100)
            except Exception as exc:
                out[f"{key}_error"] = _error_text(exc)
    return out


def _error_text(exc: Exception) -> str:
    """An error's type, first lines and last lines (an inductor error's cause comes last)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    shown = lines if len(lines) <= 10 else lines[:4] + ["..."] + lines[-6:]
    return f"{type(exc).__name__}: {' | '.join(shown)[:2000]}"


def rows(args):
    import torch

    routes = []
    for fwd, bwd in ((args.forward_launches, args.backward_launches), (1, 1)):
        built = build_routes(fwd, bwd)
        candidates = [("eager autograd.Function, direct launches", built["eager"]),
                      ("eager triton ops (dispatcher)", built["ops"]),
                      ("compiled, Python wrapper", torch.compile(built["ops"], dynamic=False, fullgraph=True))]
        if not args.no_cpp_wrapper:
            candidates.append(("compiled, C++ wrapper", torch.compile(
                built["ops"], dynamic=False, fullgraph=True, options=CPP_OPTIONS)))
        for name, f in candidates:
            try:
                us, first = timed_route(f, args.calls)
                routes.append({"route": name, "launches": fwd + bwd, "host_us": us, "first_call_s": first})
            except Exception as exc:
                routes.append({"route": name, "launches": fwd + bwd, "host_us": None,
                               "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
    return routes


def per_launch(routes, launches: int):
    """{route: (us per extra launch, fixed us of the region)} from the full chain and the 1 + 1 one."""
    by = {(r["route"], r["launches"]): r["host_us"] for r in routes}
    out = {}
    for (name, n), us in by.items():
        one = by.get((name, 2))
        if n == launches and n != 2 and us is not None and one is not None:
            slope = (us - one) / (n - 2)
            out[name] = (slope, one - 2 * slope)
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_compiled_launch: needs a CUDA GPU (inductor runs user Triton kernels on CUDA only)")
    import triton

    if args.static_user_launch:
        import torch._inductor.config as inductor_config

        inductor_config.static_launch_user_defined_triton_kernels = True
    narrow_cpp_tma_boxes()
    table = rows(args)
    launches = args.forward_launches + args.backward_launches
    derived = per_launch(table, launches)
    product = product_routes(max(1, args.calls // 4))
    layers = [layer_routes(name, cpp, args.layer_profile) for name in args.layer_cases.split(",") if name
              for cpp in ((False,) if args.no_cpp_wrapper else (False, True))]
    forwards = [forward_routes(name) for name in args.forward_cases.split(",") if name]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "calls": args.calls, "forward_launches": args.forward_launches,
            "backward_launches": args.backward_launches, "static_user_launch": args.static_user_launch}
    print(f"host microseconds per forward + backward ({meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']})")
    width = max(len(r["route"]) for r in table)
    print(f"{'route':<{width}}  launches  host us  first call s")
    for r in table:
        cell = f"{r['host_us']:7.1f}" if r["host_us"] is not None else f"error: {r['error']}"
        print(f"{r['route']:<{width}}  {r['launches']:8d}  {cell}  {r.get('first_call_s', 0):6.1f}")
    print("\nper route: us per extra launch, fixed us per forward + backward region")
    for name, (slope, fixed) in derived.items():
        print(f"{name:<{width}}  {slope:6.1f}  {fixed:7.1f}")
    print(f"\nops.sdd_gelu as called today: {product['eager_host_us']:.1f} us host; under dynamo "
          f"{product['graph_breaks']} graph break(s), first: {product['first_reason']}")
    for reason in product.get("reasons", [])[1:]:
        print(f"  then: {reason}")
    if "compiled_error" in product:
        print(f"ops.sdd_gelu compiled: error: {product['compiled_error']}")
    else:
        print(f"ops.sdd_gelu compiled: {product['compiled_host_us']:.1f} us host, "
              f"max |difference| {product['compiled_max_abs_diff']:.3g}")
    for lr in layers:
        wrapper = " (C++ wrapper)" if lr["cpp_wrapper"] else ""
        print(f"\n{lr['case']}{wrapper}, sparse layer, forward + backward (host: medians of 3): "
              f"eager host {lr['eager_host_ms']:.2f} ms "
              f"(dense chain {lr['dense_host_ms']:.2f}), step {lr['eager_ms']:.2f} ms; under dynamo "
              f"{lr.get('graph_breaks')} graph break(s) in {lr.get('graphs')} graph(s)")
        for reason in lr.get("reasons", []):
            print(f"  break: {reason}")
        if "compiled_error" in lr:
            print(f"  compiled: error: {lr['compiled_error']}")
        else:
            ratio = lr["compiled_host_ms"] / lr["dense_host_ms"]
            print(f"  compiled: host {lr['compiled_host_ms']:.2f} ms ({ratio:.2f}x "
                  f"the dense chain's), step {lr['compiled_ms']:.2f} ms, max relative difference "
                  f"{lr['max_rel_diff']:.3g}; launches {lr['compiled_launches']} (eager {lr['eager_launches']})")
            if "compiled_profile" in lr:
                print(lr["compiled_profile"])
    if forwards:
        print("\nthe sparse layer's forward alone (no grad), host ms (x the dense chain's forward), "
              "step ms, max relative difference from eager")
    for fr in forwards:
        print(f"{fr['case']}: dense chain {fr['dense_host_ms']:.3f}; eager {fr['eager_host_ms']:.3f} "
              f"({fr['eager_host_ms'] / fr['dense_host_ms']:.1f}x), step {fr['eager_ms']:.3f}")
        for key, name in (("python", "compiled, Python wrapper"), ("cpp", "compiled, C++ wrapper")):
            if f"{key}_error" in fr:
                print(f"  {name}: error: {fr[f'{key}_error']}")
            else:
                print(f"  {name}: {fr[f'{key}_host_ms']:.3f} ({fr[f'{key}_host_ms'] / fr['dense_host_ms']:.1f}x), "
                      f"step {fr[f'{key}_ms']:.3f}, difference {fr[f'{key}_max_rel_diff']:.3g}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": table,
                       "per_launch": {k: {"us_per_launch": s, "fixed_us": f} for k, (s, f) in derived.items()},
                       "product": product, "layers": layers, "forwards": forwards}, fh, indent=1)
    return table


if __name__ == "__main__":
    main()
