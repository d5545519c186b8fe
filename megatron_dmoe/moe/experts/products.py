"""The sparse backend's four expert products, in bf16 (the block-sparse kernels as given) or in
block-scaled fp8 (training.fp8: blockwise, DeepSeek-V3's recipe: 1 x 128 scales on the rows of
activations and gradients, 128 x 128 on weights, fp32 accumulation):

  hidden(x, w1, v1, topo, act)    h1 = x w1^T [, h2 = x v1^T], a = act(h1 [, h2])
  down(a, topo, w2)               y = a w2
  output_grad(g, topo, w2)        da = g w2^T
  input_grad(d_h1, d_h2, topo, w1, v1, counters)
                                  dx = d_h1 w1 [+ d_h2 v1]

The weight gradients stay with sparse.py (bf16 DSD^T products into main_grad, in both modes).
An Fp8Products is made per forward call: it keeps the weights' fp8 copies (quantized once, in the
forward) for that call's backward, a quarter of the bf16 weights' bytes each.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..options import FP8_MODES


def _flat(w: torch.Tensor) -> torch.Tensor:
    E, f, h = w.shape
    return w.reshape(E * f, h)


class Bf16Products:
    """The products in the weights' own dtype, GELU's activation from the first product's epilogue."""

    windows = True  # d_h1 / d_h2 stored into the weight-gradient windows' slots and read there (ops.dsd's slot)

    def hidden(self, x, w1, v1, topology, activation):
        from dmoe_kernels import activation as act, ops

        if activation == "gelu" and v1 is None:
            h1, a = ops.sdd_gelu(x, _flat(w1).t(), topology)
            return h1, None, a
        h1 = ops.sdd(x, _flat(w1).t(), topology)
        h2 = ops.sdd(x, _flat(v1).t(), topology) if v1 is not None else None
        return h1, h2, act.activation_forward(activation, h1, h2, topology.nnz)

    def down(self, a, topology, w2):
        from dmoe_kernels import ops

        return ops.dsd(a, topology, _flat(w2))

    def output_grad(self, g, topology, w2):
        from dmoe_kernels import ops

        return ops.sdd(g, _flat(w2).t(), topology)

    def input_grad(self, d_h1, d_h2, topology, w1, v1, counters=(None, None)):
        from dmoe_kernels import ops

        dx = ops.dsd(d_h1, topology, _flat(w1), slot=counters[0])
        if v1 is not None:
            dx += ops.dsd(d_h2, topology, _flat(v1), slot=counters[1])
        return dx


class Fp8Products:
    """The products in block-scaled fp8 (dmoe_kernels.products.fp8_ops): each left operand quantized
    in 1 x 128 row tiles as it is consumed, each weight in 128 x 128 blocks once per forward. The
    activation is a separate pass over h1 (the fp8 SDD has no GELU epilogue). The activation's
    backward does not store its rows into the weight-gradient windows' slots (the fp8 input-gradient
    product reads its own quantized copy of d_h1, not a slot): the windows take copies of a, d_h1
    and x instead, as where the direct stores cannot be made."""

    windows = False  # no direct stores into the windows' slots (see sparse.py, _windows_wanted)

    def __init__(self):
        # ("w1" | "v1" | "w2", K-major?) -> (e4m3 [E*f, h], fp32 scales): made once per forward call
        # and layout, kept for the backward
        self._weights = {}

    def _quantized(self, name: str, w: torch.Tensor, kmajor: bool = False):
        """w [E, f, h] as [E*f, h] in 128 x 128 blocks: row-major, or K-major (the transpose of a
        row-major [h, E*f], quantized as such: the same blocks and values, no strided copy), the
        layout the fp8 DSD's tensor cores read fastest."""
        key = (name, kmajor)
        if key not in self._weights:
            from dmoe_kernels.fp8 import ops as fp8

            if kmajor:
                qt, st = fp8.quantize_blocks(_flat(w).t())
                self._weights[key] = (qt.t(), st.t())
            else:
                self._weights[key] = fp8.quantize_blocks(_flat(w))
        return self._weights[key]

    @staticmethod
    def _rows(x: torch.Tensor):
        from dmoe_kernels.fp8 import ops as fp8

        return fp8.quantize_rows(x)

    def _sdd(self, rows, name, w, topology, out_dtype):
        """rows: (e4m3 rows, their scales) from _rows."""
        from dmoe_kernels.products.fp8_ops import sdd_fp8

        aq, a_scale = rows
        wq, w_scale = self._quantized(name, w)
        return sdd_fp8(aq, a_scale, wq, w_scale, topology, out_dtype=out_dtype)

    def _dsd(self, data, topology, name, w, out_dtype):
        from dmoe_kernels.products.fp8_ops import dsd_fp8, quantize_blocks_rows

        q, q_scale = quantize_blocks_rows(data)
        wq, w_scale = self._quantized(name, w, kmajor=True)
        return dsd_fp8(q, q_scale, topology, wq, w_scale, out_dtype=out_dtype)

    def hidden(self, x, w1, v1, topology, activation):
        from dmoe_kernels import activation as act

        rows = self._rows(x)  # once for both products
        h1 = self._sdd(rows, "w1", w1, topology, x.dtype)
        h2 = self._sdd(rows, "v1", v1, topology, x.dtype) if v1 is not None else None
        return h1, h2, act.activation_forward(activation, h1, h2, topology.nnz)

    def down(self, a, topology, w2):
        return self._dsd(a, topology, "w2", w2, a.dtype)

    def output_grad(self, g, topology, w2):
        return self._sdd(self._rows(g), "w2", w2, topology, g.dtype)

    def input_grad(self, d_h1, d_h2, topology, w1, v1, counters=(None, None)):
        if counters != (None, None):
            raise RuntimeError("the fp8 expert products do not read weight-gradient window slots")
        dx = self._dsd(d_h1, topology, "w1", w1, d_h1.dtype)
        if v1 is not None:
            dx += self._dsd(d_h2, topology, "v1", v1, d_h2.dtype)
        return dx


BF16 = Bf16Products()


def products_for(fp8: Optional[str]):
    """The products one forward call runs: the shared bf16 ones, or a fresh Fp8Products."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"the expert products' fp8 mode must be one of {FP8_MODES}, got {fp8!r}")
    return BF16 if fp8 is None else Fp8Products()
