"""Where a profiled training step's GPU time goes, by kind of work rather than by kernel name.

`bench_train.py --profile DIR` sums each kernel's GPU time over one step; this module sorts those
kernels into the parts a reader of the step cares about (the exchange's waits, the expert
products, their weight gradients, the optimizer, ...) by their names, and prints one line per part
with its share of the step's wall time. A kernel no rule names counts as "rest" (attention, the
dense layers' matmuls, norms, the loss, copies).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Tuple

# (part, pattern on the kernel's name), first match wins: the order matters where names overlap
# (dsdt before dsd, the exchange's pushes before the permutation's row moves).
PARTS: Tuple[Tuple[str, str], ...] = (
    ("exchange waits", r"barrier_kernel|nccl"),
    ("exchange rows", r"^(push_rows|push_copies|push_to_targets|post_counts|exchange_plan|return_targets)_kernel$"),
    ("weight gradients", r"^dsdt"),
    ("wgrad slot copies", r"^copy_to_slot_kernel$"),  # moe.expert_wgrad_window's narrow operands
    ("expert products", r"^(sdd|dsd)(_tma)?_kernel$|grouped_mm|grouped_gemm"),
    # this project's Triton kernels are named plainly; torch's own (at::native::reduce_kernel<...>) are not
    ("permutation", r"^(expand|gather_rows|reduce|weighted_backward|block_histogram|block_positions"
                    r"|expert_prefix|expert_index|scatter_rows)_kernel$"),
    ("expert activation", r"^activation_(forward|backward)_kernel$"),
    ("router", r"^(route_forward|route_backward|balance_loss|balance_loss_backward)_kernel$"),
    ("optimizer", r"FusedOptimizer|adam|LpNorm|l2norm"),
)
ORDER = [name for name, _ in PARTS] + ["rest"]
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in PARTS]


def part_of(kernel: str) -> str:
    for name, pattern in _COMPILED:
        if pattern.search(kernel):
            return name
    return "rest"


def breakdown(kernels: Iterable[Tuple[str, float, int]]) -> Dict[str, Dict[str, float]]:
    """(kernel name, GPU ms, calls) triples -> {part: {"ms": ..., "calls": ...}} for every part."""
    parts = {name: {"ms": 0.0, "calls": 0} for name in ORDER}
    for name, ms, calls in kernels:
        part = parts[part_of(name)]
        part["ms"] += ms
        part["calls"] += calls
    return parts


def expert_wgrad_flops(cfg, tokens_per_gpu: int) -> float:
    """Useful FLOPs of the expert weight gradients in one step on one GPU (each equals its forward
    product). Padding rows are not counted; with expert parallelism a GPU's experts receive its own
    tokens' share of the routed copies on average."""
    from megatron_dmoe.training.flops import expert_flops_per_token

    return tokens_per_gpu * expert_flops_per_token(cfg)


def summary_lines(parts: Dict[str, Dict[str, float]], wall_ms: float, wgrad_flops: float = 0.0) -> List[str]:
    """One line per part that ran (GPU ms, share of the step's wall time, calls), then the time no
    kernel ran; the weight gradients with their useful TFLOP/s when `wgrad_flops` is given."""
    lines = [f"  {'part':18s} {'GPU ms':>9s} {'of step':>8s} {'calls':>7s}"]
    busy = 0.0
    for name in ORDER:
        part = parts[name]
        if not part["calls"]:
            continue
        busy += part["ms"]
        extra = ""
        if name == "weight gradients" and wgrad_flops and part["ms"] > 0:
            extra = f"  {wgrad_flops / (part['ms'] * 1e-3) / 1e12:.0f} TFLOP/s useful"
        lines.append(f"  {name:18s} {part['ms']:9.1f} {100 * part['ms'] / wall_ms:7.1f}% {part['calls']:7d}{extra}")
    idle = max(wall_ms - busy, 0.0)
    lines.append(f"  {'no kernel running':18s} {idle:9.1f} {100 * idle / wall_ms:7.1f}%")
    return lines
