"""`reference` backend: a python loop of per-expert matmuls. Any device and dtype; the ground truth."""
from __future__ import annotations

import torch

from .gemm import GroupedGemm
from .mlp import GemmBackend


class LoopGemm(GroupedGemm):
    def __init__(self, tokens_per_expert: torch.Tensor):
        # the group sizes come to the host: this backend is for correctness, not speed
        self.sizes = tokens_per_expert.tolist()

    def nt(self, x, w):
        return torch.cat([xe @ w[e].t() for e, xe in enumerate(x.split(self.sizes))])

    def nn(self, x, w):
        return torch.cat([xe @ w[e] for e, xe in enumerate(x.split(self.sizes))])

    def tn(self, a, b):
        pairs = zip(a.split(self.sizes), b.split(self.sizes))
        return torch.stack([ae.t() @ be for ae, be in pairs])


class ReferenceBackend(GemmBackend):
    name = "reference"

    def unsupported_reason(self, device, dtype, hidden_size, ffn_hidden_size):
        return None

    def make_gemm(self, tokens_per_expert):
        return LoopGemm(tokens_per_expert)
