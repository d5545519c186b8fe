"""dmoe_kernels: block-sparse matrix products in Triton for dropless Mixture-of-Experts.

The folder is ``kernels/`` in the repository; it is imported as ``dmoe_kernels`` (a different
package named ``kernels`` exists on the package registry). It depends on torch and triton only.

  Topology                  blocked-CSR metadata with a transposed view (topology.py)
  Topology.for_experts      the dMoE pattern from tokens-per-expert counts, built on the device
  Topology.from_mask        any pattern, from a boolean block mask
  sdd, dsd, dds             differentiable products (functional.py)
  ops.sdd, ops.dsd, ops.dds the same products without autograd (ops.py)
  reference                 pure-torch versions of every op (reference.py)
  permute, unpermute        fused Triton permutation into / out of the expert-grouped, block-padded
                            buffer, differentiable (permute_functional.py); permute_ops has the same
  permute_ops               kernels without autograd and the routing positions computed on the device
                            (permute_ops.py; references in permute_reference.py)
  launch                    what every launch shares: device checks, program counts, TMA readiness
  activation                GELU / SwiGLU on sparse data over the existing blocks (activation.py)
  regroup                   sum_m S_m^T @ B_m over micro-batches as one product, rows regrouped by
                            expert (regroup.py): weight gradients accumulated once per step
  fused_route               softmax top-k routing with the load-balancing loss's column sums, one
                            kernel (and the sums' reduction) forward, one backward
                            (router_functional.py); router_ops has the kernels without autograd
  balance_loss              the load-balancing loss from those column sums, one launch each way

See README.md in this folder for an example.
"""
from . import activation, launch, ops, permute_ops, permute_reference, reference, regroup, router_ops
from .functional import dds, dsd, sdd
from .permute_functional import permute, unpermute
from .router_functional import balance_loss, fused_route
from .topology import Topology, max_padded_rows, padded_expert_offsets
from .tuning import DsdConfig, SddConfig

__all__ = [
    "Topology",
    "max_padded_rows",
    "padded_expert_offsets",
    "sdd",
    "dsd",
    "dds",
    "ops",
    "reference",
    "permute_ops",
    "permute_reference",
    "permute",
    "unpermute",
    "activation",
    "launch",
    "regroup",
    "router_ops",
    "fused_route",
    "balance_loss",
    "SddConfig",
    "DsdConfig",
]
