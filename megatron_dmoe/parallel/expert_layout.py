"""Which part of which expert each expert-parallel rank holds.

E experts over EP ranks, in one of two layouts:
  * EP divides E: rank r holds the whole experts r*E/EP ... (r+1)*E/EP - 1;
  * E divides EP (more ranks than experts): each expert's FFN is cut into S = EP/E shards along
    the ffn dimension, and rank r holds shard r % S of expert r // S.
Both are one rule over "virtual experts" v = e*S + s (S = 1 in the first layout): virtual expert v
is shard v % S of expert v // S, of width f/S, and rank r holds the V/EP consecutive virtual experts
starting at r*V/EP (V = E*S). A token routed to expert e is sent to its S virtual experts; as an
MLP with a split hidden layer is the sum of its parts, y = sum_s W2_s^T act(W1_s x), the combine's
weighted sum adds the partial outputs back together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    ffn_hidden_size: int
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self):
        E, ep, f = self.num_experts, self.ep_size, self.ffn_hidden_size
        if ep < 1 or not 0 <= self.ep_rank < ep:
            raise ValueError(f"expert-parallel rank {self.ep_rank} of size {ep} is not a valid rank.")
        if E % ep and ep % E:
            raise ValueError(
                f"expert_model_parallel_size={ep} neither divides num_experts={E} nor is a multiple of it; "
                f"use a divisor of {E} or a multiple of {E}."
            )
        if f % self.shards_per_expert:
            raise ValueError(
                f"expert_model_parallel_size={ep} splits each of the {E} experts into {self.shards_per_expert} "
                f"ffn shards, but the expert ffn_hidden_size={f} is not divisible by {self.shards_per_expert}; "
                f"use an ffn size that is a multiple of {self.shards_per_expert}."
            )

    @property
    def shards_per_expert(self) -> int:
        """S: ranks that share one expert (1 unless there are more ranks than experts)."""
        return max(1, self.ep_size // self.num_experts)

    @property
    def num_virtual_experts(self) -> int:
        return self.num_experts * self.shards_per_expert

    @property
    def num_local_experts(self) -> int:
        """Virtual experts (whole experts, or one expert shard) on each rank."""
        return self.num_virtual_experts // self.ep_size

    @property
    def local_ffn_hidden_size(self) -> int:
        return self.ffn_hidden_size // self.shards_per_expert

    @property
    def first_local_virtual(self) -> int:
        return self.ep_rank * self.num_local_experts

    def local_shape(self, hidden_size: int) -> Tuple[int, int, int]:
        return (self.num_local_experts, self.local_ffn_hidden_size, hidden_size)

    def virtual_owner(self, v: int) -> Tuple[int, int]:
        """(global expert id, ffn shard) of virtual expert v."""
        return v // self.shards_per_expert, v % self.shards_per_expert

    def local_virtual_experts(self) -> range:
        return range(self.first_local_virtual, self.first_local_virtual + self.num_local_experts)

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part [local experts, f/S, ...] of a global expert tensor [E, f, ...]."""
        if full.shape[0] != self.num_experts or full.shape[1] != self.ffn_hidden_size:
            raise ValueError(
                f"global expert tensor has shape {tuple(full.shape)}; expected "
                f"[{self.num_experts}, {self.ffn_hidden_size}, ...]"
            )
        width = self.local_ffn_hidden_size
        parts = []
        for v in self.local_virtual_experts():
            expert, shard = self.virtual_owner(v)
            parts.append(full[expert, shard * width : (shard + 1) * width])
        return torch.stack(parts)

    def assemble(self, parts) -> torch.Tensor:
        """The global [E, f, ...] tensor from every rank's local share (a list in rank order);
        the inverse of `local_slice` over all ranks."""
        if len(parts) != self.ep_size:
            raise ValueError(
                f"assemble needs one local tensor per expert-parallel rank ({self.ep_size}), got {len(parts)}"
            )
        width = self.local_ffn_hidden_size
        first = parts[0]
        full = first.new_empty((self.num_experts, self.ffn_hidden_size) + tuple(first.shape[2:]))
        for rank, part in enumerate(parts):
            owner = ExpertLayout(self.num_experts, self.ffn_hidden_size, self.ep_size, rank)
            for i, v in enumerate(owner.local_virtual_experts()):
                expert, shard = owner.virtual_owner(v)
                full[expert, shard * width : (shard + 1) * width] = part[i]
        return full

    def global_offsets(self) -> Tuple[Tuple[int, int, int], ...]:
        """Where the local tensor sits in the global [E, f, h] one, as dist_checkpointing's
        (axis, chunk index, number of chunks) triples."""
        if self.shards_per_expert == 1:
            return ((0, self.ep_rank, self.ep_size),)
        expert, shard = self.virtual_owner(self.first_local_virtual)
        return ((0, expert, self.num_experts), (1, shard, self.shards_per_expert))
