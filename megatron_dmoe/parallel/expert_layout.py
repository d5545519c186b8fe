"""Which part of which expert each rank of the expert exchange holds.

E experts over the R = EP x ETP ranks of the exchange (megatron's expert-tensor-and-model-parallel
group: expert parallelism EP, each expert's FFN split over ETP expert-tensor-parallel ranks; rank
g = ep_rank * ETP + etp_rank). Each expert's FFN is cut along the ffn dimension into
S = ETP x max(1, EP / E) shards; S consecutive ranks hold the same L = max(1, E / EP) experts, each
one shard of them: rank g holds shard g % S of experts (g // S) * L ... (g // S) * L + L - 1.
  * ETP = 1, EP divides E: whole experts, L = E / EP per rank;
  * ETP = 1, E divides EP (more ranks than experts): S = EP / E ranks share each expert;
  * ETP > 1: experts split over their expert-tensor-parallel ranks as well.
All are one rule over "virtual experts": rank g holds the L consecutive virtual experts g*L ...,
virtual expert g*L + i being shard g % S of expert (g // S) * L + i, of width f/S. A token routed to
expert e is sent to its S virtual experts; as an MLP with a split hidden layer is the sum of its
parts, y = sum_s W2_s^T act(W1_s x), the combine's weighted sum adds the partial outputs together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from megatron_dmoe.parallel.layout_rules import ffn_shards_per_expert


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    ffn_hidden_size: int
    ep_size: int = 1  # ranks of the exchange: expert-parallel x expert-tensor-parallel
    ep_rank: int = 0  # this rank among them
    expert_tensor_size: int = 1  # ETP: ranks each expert's FFN is split over by choice

    def __post_init__(self):
        E, ranks, f, etp = self.num_experts, self.ep_size, self.ffn_hidden_size, self.expert_tensor_size
        if ranks < 1 or not 0 <= self.ep_rank < ranks:
            raise ValueError(f"expert-parallel rank {self.ep_rank} of size {ranks} is not a valid rank.")
        if etp < 1 or ranks % etp:
            raise ValueError(f"expert_tensor_parallel_size={etp} does not divide the {ranks} ranks of the "
                             "expert exchange (expert x expert-tensor parallel sizes).")
        ep = ranks // etp
        if E % ep and ep % E:
            raise ValueError(
                f"expert_model_parallel_size={ep} neither divides num_experts={E} nor is a multiple of it; "
                f"use a divisor of {E} or a multiple of {E}."
            )
        shards = self.shards_per_expert
        if f % shards:
            raise ValueError(
                f"expert_model_parallel_size={ep} x expert_tensor_parallel_size={etp} splits each of the {E} "
                f"experts into {shards} ffn shards, but the expert ffn_hidden_size={f} is not divisible by "
                f"{shards}; use an ffn size that is a multiple of {shards}."
            )

    @property
    def shards_per_expert(self) -> int:
        """S: ranks that share one expert, each holding one ffn shard of it."""
        return ffn_shards_per_expert(self.num_experts, self.ep_size // self.expert_tensor_size,
                                     self.expert_tensor_size)

    @property
    def num_virtual_experts(self) -> int:
        return self.num_experts * self.shards_per_expert

    @property
    def num_local_experts(self) -> int:
        """L: virtual experts (whole experts, or one shard of each of L experts) on each rank."""
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
        L, S = self.num_local_experts, self.shards_per_expert
        rank, i = divmod(v, L)
        return (rank // S) * L + i, rank % S

    def virtual_experts(self, experts: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] -> the virtual experts holding their shards [T, k*S], the S shards of
        each assignment side by side (the inverse of `virtual_owner`)."""
        L, S = self.num_local_experts, self.shards_per_expert
        if S == 1:
            return experts
        shards = torch.arange(S, device=experts.device, dtype=experts.dtype)
        e = experts.unsqueeze(-1)
        return (((e // L) * S + shards) * L + e % L).flatten(1)

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
            owner = ExpertLayout(self.num_experts, self.ffn_hidden_size, self.ep_size, rank, self.expert_tensor_size)
            for i, v in enumerate(owner.local_virtual_experts()):
                expert, shard = owner.virtual_owner(v)
                full[expert, shard * width : (shard + 1) * width] = part[i]
        return full

    def global_offsets(self) -> Tuple[Tuple[int, int, int], ...]:
        """Where the local tensor sits in the global [E, f, h] one, as dist_checkpointing's
        (axis, chunk index, number of chunks) triples."""
        S, L = self.shards_per_expert, self.num_local_experts
        if S == 1:
            return ((0, self.ep_rank, self.ep_size),)
        block, shard = divmod(self.ep_rank, S)
        return ((0, block, self.num_experts // L), (1, shard, S))
