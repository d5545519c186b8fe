"""megatron-core's parallel linear layers with the bias added inside the matmul when unsharded.

Without Transformer Engine, megatron's ColumnParallelLinear and RowParallelLinear add the bias as a
separate broadcast add: inside the layer (`linear_qkv`), or returned under skip_bias_add and added
later by the MLP (`linear_fc1`) or by bias-dropout-add (`linear_proj`, `linear_fc2`). Each add is
one more pass over the layer's output, and the four per transformer layer were a visible share of a
GPT Small training step (docs/performance.md, "Bias adds outside the matmul"). At tensor-parallel
size 1 these subclasses call F.linear, whose cuBLAS epilogue adds the bias, and return no separate
bias (megatron's callers skip a None bias).
The backward is the same arithmetic: the input and weight gradients, and the bias gradient as the
sum of the output gradient over tokens.

Anything megatron's own path handles beyond a plain matmul (tensor or sequence parallelism,
gradient-accumulation fusion, deferred embedding gradients, CPU offloading, expert communication)
takes that path unchanged. `fuse_bias = False` on an instance does too.

Fp8ColumnLinear / Fp8RowLinear (training.fp8: blockwise) run the same plain matmul's forward and
input-gradient products in block-scaled fp8 (dmoe_kernels.fp8.functional.linear) and its weight
gradient in bf16, as the experts' (moe/experts/products.py); the bias is added in bf16. The
configuration check refuses fp8 with the settings that leave the plain matmul (tensor or sequence
parallelism); a layer that still finds itself outside it says so rather than train in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _plain_matmul(layer, unsharded: bool) -> bool:
    """Does megatron's forward reduce to y = x W^T + b for this layer?"""
    config = layer.config
    offloading = getattr(config, "_cpu_offloading_context", None)
    return (
        getattr(layer, "fuse_bias", True)
        and unsharded
        and not layer.sequence_parallel
        and not layer.gradient_accumulation_fusion
        and not getattr(layer, "explicit_expert_comm", False)
        and not getattr(config, "defer_embedding_wgrad_compute", False)
        and not (offloading is not None and getattr(offloading, "inside_context", False))
    )


class FusedBiasColumnLinear(ColumnParallelLinear):
    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        if weight is not None or not _plain_matmul(self, self.output_size_per_partition == self.output_size):
            return super().forward(input_, weight, runtime_gather_output)
        if self.weight is None:
            raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                               "and skip_weight_param_allocation is True.")
        return F.linear(input_, self.weight, self.bias), None


class FusedBiasRowLinear(RowParallelLinear):
    def forward(self, input_: torch.Tensor):
        if not _plain_matmul(self, self.input_size_per_partition == self.input_size):
            return super().forward(input_)
        return F.linear(input_, self.weight, self.bias), None


def _fp8_linear(layer, input_: torch.Tensor, unsharded: bool):
    if not _plain_matmul(layer, unsharded):
        raise RuntimeError(f"{type(layer).__name__}: training.fp8 runs unsharded linears only (tensor-parallel "
                           "size 1, no sequence parallelism, no gradient-accumulation fusion); set "
                           "training.fp8: null for this layout")
    from dmoe_kernels.fp8.functional import linear

    # the weight gradient in bf16: as an fp8 product it needs dy and x quantized along the tokens
    # (two transposed passes), which cost more than its fp8 speed gains (docs/kernels.md)
    return linear(input_, layer.weight, layer.bias, fp8_wgrad=False), None


class Fp8ColumnLinear(FusedBiasColumnLinear):
    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        if weight is not None:
            raise RuntimeError("Fp8ColumnLinear: an externally supplied weight is not run in fp8")
        return _fp8_linear(self, input_, self.output_size_per_partition == self.output_size)


class Fp8RowLinear(FusedBiasRowLinear):
    def forward(self, input_: torch.Tensor):
        return _fp8_linear(self, input_, self.input_size_per_partition == self.input_size)
