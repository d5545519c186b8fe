"""The experts' weights and the module that runs them through the chosen backend."""
from __future__ import annotations

import torch

from ..options import MoEOptions
from .backends import check_backend_name, resolve_backend
from .gemm import BatchedGemm
from .mlp import expert_mlp


class ExpertMLP(torch.nn.Module):
    """Weights w1, w2 (and v1 for SwiGLU), each [E, ffn, hidden], no biases.

    Expert i computes y = act(x w1[i]^T [, x v1[i]^T]) w2[i].
    """

    def __init__(self, options: MoEOptions, dtype=torch.float32, device=None):
        super().__init__()
        check_backend_name(options.backend)
        self.options = options
        shape = (options.num_experts, options.ffn_hidden_size, options.hidden_size)

        def weight():
            w = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            with torch.no_grad():
                w.normal_(0.0, options.init_method_std)
            # replicated on every data-parallel rank for now; expert parallelism will set False
            w.allreduce = True
            return w

        self.w1 = weight()
        self.v1 = weight() if options.activation == "swiglu" else None
        self.w2 = weight()

    def backend_for(self, x: torch.Tensor):
        opts = self.options
        return resolve_backend(opts.backend, x.device, x.dtype, opts.hidden_size, opts.ffn_hidden_size)

    def forward(self, x_perm: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_perm [N, h] grouped by expert (expert order), tokens_per_expert [E] -> [N, h]."""
        opts = self.options
        return self.backend_for(x_perm).mlp(
            x_perm, tokens_per_expert, self.w1, self.v1, self.w2, opts.activation, opts.memory_optimized
        )

    def forward_batched(self, x_buf: torch.Tensor) -> torch.Tensor:
        """x_buf [E, capacity, h] (the token-dropping baseline) -> [E, capacity, h], by torch.bmm."""
        E, capacity, h = x_buf.shape
        gemm = BatchedGemm(E, capacity)
        y = expert_mlp(
            x_buf.reshape(E * capacity, h), self.w1, self.v1, self.w2, gemm,
            self.options.activation, self.options.memory_optimized,
        )
        return y.view(E, capacity, h)
