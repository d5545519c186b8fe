"""The one line dmoe-train prints when CUDA, or the host's memory, runs out during training: what
was asked for, what the card holds, and the settings that lower the peak without changing the
results."""
from __future__ import annotations

import re
from typing import Optional

from megatron_dmoe.config.schema import RunConfig

_SIZE = r"([0-9.]+ [KMGT]?i?B)"


def allocation_asked(text: str) -> Optional[str]:
    """The size torch's out-of-memory message says it tried to allocate ('1.95 GiB'), or None."""
    found = re.search(r"Tried to allocate " + _SIZE, text)
    return found.group(1) if found else None


def out_of_memory_message(err: BaseException, cfg: RunConfig) -> str:
    text = str(err)
    asked = allocation_asked(text)
    total = re.search(r"total capacity of " + _SIZE, text)
    facts = "; ".join(part for part in (
        f"tried to allocate {asked}" if asked else "",
        f"the GPU holds {total.group(1)}" if total else "",
    ) if part)
    t = cfg.training
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append(f"lower training.micro_batch_size (now {t.micro_batch_size}; the global batch of "
                     f"{t.global_batch_size}, and so the results, stay the same)")
    if cfg.moe.num_experts and not cfg.moe.memory_optimized:
        fixes.append("set moe.memory_optimized: true (MoE layers recompute their activation in backward)")
    if t.cuda_graphs is not False:  # true, or auto (which captures wherever it is correct)
        fixes.append(f"set training.cuda_graphs: false (now {t.cuda_graphs}; captured layers keep memory pools of "
                     "their own, and an eager step may fit where a captured one does not)")
    if t.recompute_granularity is None:
        fixes.append("set training.recompute_granularity: selective or full")
    advice = ", or ".join(fixes) if fixes else "use a GPU with more memory or more GPUs (parallel.*)"
    return (f"CUDA ran out of memory during training ({facts or 'no size reported'}); to fit, {advice}. "
            "Continue with --resume from the newest complete checkpoint, if any.")


# torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"
_HOST_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _host_allocation_failure(err: BaseException) -> Optional[BaseException]:
    """The allocation failure in `err` or what it was raised from (a wrapping error's chain)."""
    from megatron_dmoe.training.write_errors import causes

    for cause in causes(err):
        if isinstance(cause, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(cause):
            return cause
    return None


def host_out_of_memory_message(err: BaseException, cfg: RunConfig, processes: int) -> Optional[str]:
    """The line for the host's memory running out (torch's CPU allocator, or Python's MemoryError),
    also where another error was raised from it; None for any other error."""
    failure = _host_allocation_failure(err)
    if failure is None:
        return None
    found = _HOST_ALLOCATION.search(str(failure))
    asked = f"tried to allocate {int(found.group(1)) / 2**30:.2f} GiB" if found else "no size reported"
    t = cfg.training
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append(f"lower training.micro_batch_size (now {t.micro_batch_size}; the results stay the same)")
    if cfg.moe.num_experts and not cfg.moe.memory_optimized:
        fixes.append("set moe.memory_optimized: true")
    if t.recompute_granularity is None:
        fixes.append("set training.recompute_granularity: full")
    fixes.append("train a smaller model (model.hidden_size, model.num_layers, moe.num_experts)")
    if processes > 1:
        fixes.append(f"start fewer processes (now {processes})")
    return (f"the machine ran out of memory during training ({asked}); to fit, " + ", or ".join(fixes)
            + ". Continue with --resume from the newest complete checkpoint, if any.")
