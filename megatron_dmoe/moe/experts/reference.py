"""`reference` backend: a python loop of per-expert matmuls. Any device and dtype; the ground truth."""
from __future__ import annotations

import torch

from .gemm import GroupedGemm
from .mlp import GemmBackend


class LoopGemm(GroupedGemm):
    """Rows past the last group (a bound-sized buffer's tail) give zero rows and no weight gradient."""

    def __init__(self, tokens_per_expert: torch.Tensor):
        # the group sizes come to the host: this backend is for correctness, not speed
        self.sizes = tokens_per_expert.tolist()

    def _groups(self, x):
        return x.split(self.sizes + [x.shape[0] - sum(self.sizes)])

    def nt(self, x, w):
        *groups, tail = self._groups(x)
        return torch.cat([xe @ w[e].t() for e, xe in enumerate(groups)] + [tail.new_zeros(tail.shape[0], w.shape[1])])

    def nn(self, x, w):
        *groups, tail = self._groups(x)
        return torch.cat([xe @ w[e] for e, xe in enumerate(groups)] + [tail.new_zeros(tail.shape[0], w.shape[2])])

    def tn(self, a, b):
        pairs = zip(self._groups(a)[:-1], self._groups(b)[:-1])
        return torch.stack([ae.t() @ be for ae, be in pairs])


class ReferenceBackend(GemmBackend):
    name = "reference"

    def unsupported_reason(self, device, dtype, hidden_size, ffn_hidden_size):
        return None

    def make_gemm(self, tokens_per_expert):
        return LoopGemm(tokens_per_expert)
