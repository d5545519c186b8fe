"""megatron-core's fusions left uncompiled where torch has no CUDA.

megatron-core (0.16 through 0.19; checked: 0.16.1, 0.19.1) decorates its fused functions (bias-GELU,
bias-GeGLU and -SwiGLU, bias-dropout-add, ...) with torch.compile as their modules load, through
`megatron.core.jit.jit_fuser`: that imports torch's dynamo and inductor, about 2.5 s of a 6 s process
start on a CPU, paid by every process of a CPU run (each rank of torchrun, each test process), and
CPU runs gain nothing from it. Where torch has no CUDA, megatron-core's own switch
(`disable_jit_fuser`) runs right after `megatron.core.jit` loads, before any fusion is decorated:
those functions then run eagerly, as the same torch operations (0.19's MoE router compiles one
function with torch.compile itself, which still imports dynamo there). Could go once upstream
compiles its fusions on first call or only on CUDA.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

JIT_MODULE = "megatron.core.jit"


class _DisableFuserAfterLoad(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit through the other finders and, once it has run, switches its fuser
    off when torch has no CUDA. Removes itself at that import."""

    def find_spec(self, name, path=None, target=None):
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if not torch.cuda.is_available() and hasattr(module, "disable_jit_fuser"):
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module
        return spec


def fuse_only_with_cuda() -> None:
    """Arrange the above for the first import of megatron-core in this process (idempotent; no
    effect once megatron.core.jit is loaded)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _DisableFuserAfterLoad) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DisableFuserAfterLoad())
