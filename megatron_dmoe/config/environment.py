"""What the machine offers, as far as the config checks need to know.

Kept apart so that validation can be asked about another machine (a config written for GPUs,
checked on a laptop) by passing an Environment instead of probing this one.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class Environment:
    cuda: bool
    transformer_engine: bool
    apex: bool
    megatron_core: Optional[Tuple[int, int]] = None  # (major, minor) installed; None: not asked
    # the GPU's compute capability (major, minor); None: not known. detect() leaves it to be probed
    # when a check asks (gpu_capability): probing starts CUDA in this process, which only fp8 needs.
    cuda_capability: Optional[Tuple[int, int]] = None
    probe_capability: bool = field(default=False, compare=False)

    @classmethod
    def detect(cls) -> "Environment":
        return cls(cuda=cuda_available(), transformer_engine=transformer_engine_available(),
                   apex=apex_available(), megatron_core=megatron_core_release(), probe_capability=True)

    def gpu_capability(self) -> Optional[Tuple[int, int]]:
        if self.cuda_capability is None and self.probe_capability and self.cuda:
            return cuda_capability()
        return self.cuda_capability

    @classmethod
    def everything(cls) -> "Environment":
        """A machine with CUDA, Transformer Engine and apex: checks the config, not the host."""
        return cls(cuda=True, transformer_engine=True, apex=True)


def megatron_core_release() -> Optional[Tuple[int, int]]:
    """(major, minor) of the installed megatron-core, read from its metadata (nothing imported)."""
    try:
        major, minor = importlib.metadata.version("megatron-core").split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_capability() -> Optional[Tuple[int, int]]:
    """(major, minor) of this process's current GPU; None without CUDA."""
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def transformer_engine_available() -> bool:
    return _has_module("transformer_engine")


def wandb_available() -> bool:
    return _has_module("wandb")


def apex_available() -> bool:
    # The registry's package named `apex` is unrelated; NVIDIA's has apex.normalization, which
    # megatron-core's fused LayerNorm needs.
    return _has_module("apex") and _has_module("apex.normalization")
