"""Shared experts (DeepSeek-MoE, Qwen-MoE): one MLP that every token runs besides its routed experts.

Its output is added to the routed experts' combined output, optionally times a per-token sigmoid
gate sigmoid(x . g) (Qwen-MoE; megatron-core's SharedExpertMLP gate). Several shared experts of
width f are one MLP of width n * f. Its parameters are ordinary ones: replicated on every
expert-parallel rank and reduced over the data-parallel group like the router's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts.activations import activate
from .options import MoEOptions


class SharedExpertMLP(torch.nn.Module):
    """Weights w1, w2 (and v1 for SwiGLU) [shared ffn, hidden], no biases, laid out like one
    expert's; gate_weight [1, hidden] with shared_expert_gate."""

    def __init__(self, options: MoEOptions, dtype=torch.float32, device=None):
        super().__init__()
        self.activation = options.activation
        shape = (options.shared_expert_ffn_hidden_size, options.hidden_size)

        def weight(rows_cols):
            w = torch.empty(rows_cols, dtype=dtype, device=device)
            with torch.no_grad():
                w.normal_(0.0, options.init_method_std)
            return torch.nn.Parameter(w)

        self.w1 = weight(shape)
        self.v1 = weight(shape) if options.activation == "swiglu" else None
        self.w2 = weight(shape)
        self.gate_weight = weight((1, options.hidden_size)) if options.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> [T, h]."""
        h2 = F.linear(x, self.v1) if self.v1 is not None else None
        y = F.linear(activate(self.activation, F.linear(x, self.w1), h2), self.w2.t())
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
