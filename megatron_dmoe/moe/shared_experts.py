"""Shared experts (DeepSeek-MoE, Qwen-MoE): one MLP that every token runs besides its routed experts.

Its output is added to the routed experts' combined output, optionally times a per-token sigmoid
gate sigmoid(x . g) (Qwen-MoE; megatron-core's SharedExpertMLP gate). Several shared experts of
width f are one MLP of width n * f. Its parameters are ordinary ones: replicated on every
expert-parallel rank and reduced over the data-parallel group like the router's.

With `overlap` (the layer sets it under expert parallelism), `start` issues the MLP on a side CUDA
stream, so that it runs while the main stream moves tokens between ranks, and `finish` joins the
streams before its output is used. Autograd runs each op's backward on the stream of its forward,
so the backward overlaps the same way.
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
        self.overlap = False
        self._side_streams = {}  # CUDA device -> the side stream `start` issues on

    def start(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), issued on a side stream when overlapping (pass the result to `finish`)."""
        side = self._side_stream(x)
        if side is None:
            return self(x)
        side.wait_stream(torch.cuda.current_stream(x.device))  # x is ready
        with torch.cuda.stream(side):
            return self(x)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """`start`'s output, safe to use on the current stream."""
        side = self._side_streams.get(y.device) if y.is_cuda else None
        if side is not None:
            main = torch.cuda.current_stream(y.device)
            main.wait_stream(side)
            y.record_stream(main)  # its memory stays reserved until the main stream is done with it
        return y

    def _side_stream(self, x: torch.Tensor):
        if not (self.overlap and x.is_cuda):
            return None
        side = self._side_streams.get(x.device)
        if side is None:
            if torch.cuda.is_current_stream_capturing():
                return None  # made in an eager call first; none is made inside a capture
            side = self._side_streams[x.device] = torch.cuda.Stream(x.device)
        return side

    def __getstate__(self):
        # CUDA streams neither copy nor pickle: a copy of the layer (copy.deepcopy, a checkpoint of
        # the module) makes its own side streams when it first needs them
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_side_streams": {}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> [T, h]."""
        h2 = F.linear(x, self.v1) if self.v1 is not None else None
        y = F.linear(activate(self.activation, F.linear(x, self.w1), h2), self.w2.t())
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
