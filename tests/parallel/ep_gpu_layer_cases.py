"""The expert-parallel layer's cases on GPUs (test_ep_nccl*.py): test_ep_layer.py's CPU cases that
fit the processes at hand, in float32 with the sparse and reference backends and some in bfloat16,
each over the given expert exchanges, with the sizes and tolerances of real kernels."""
import torch

from ep_layer_checks import LAYER_CASES

# The sparse kernels need each rank's expert width to be a multiple of 16: 128 / 4 ranks = 32.
HIDDEN, FFN = 64, 128
# fp32 products are full precision in both backends (no TF32), so only summation order differs;
# bf16 keeps 8 significant bits.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# the CPU cases' memory-optimised case pins the grouped backend; this one runs on the two here
MEMORY_OPTIMIZED = {"ep2-E4-top2-memopt-swiglu-rank1-idle": dict(ep=2, E=4, k=2, activation="swiglu",
                                                                   memory_optimized=True, dead=[2, 3], aux=0.05)}
BF16_CASES = ("ep2-E4-top2-padding", "ep4-E2-split2-top2-swiglu")


def gpu_layer_cases(max_ep, exchanges=("nccl", "symmetric")):
    """The CPU cases that fit in `max_ep` processes, each in float32 with both backends, and the
    BF16_CASES among them in bfloat16 with the sparse backend; every one with each of `exchanges`."""
    base = {name: case for name, case in {**LAYER_CASES, **MEMORY_OPTIMIZED}.items()
            if case["ep"] <= max_ep and "backend" not in case}
    cases = {}
    for name, case in base.items():
        for exchange in exchanges:
            for backend in ("sparse", "reference"):
                cases[f"{name}-{backend}-fp32-{exchange}"] = dict(case, backend=backend, dtype=torch.float32,
                                                                  exchange=exchange)
            if name in BF16_CASES:
                cases[f"{name}-sparse-bf16-{exchange}"] = dict(case, backend="sparse", dtype=torch.bfloat16,
                                                               exchange=exchange)
    return cases
