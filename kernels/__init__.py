"""dmoe_kernels: block-sparse matrix products in Triton for dropless Mixture-of-Experts.

The folder is ``kernels/`` in the repository; it is imported as ``dmoe_kernels`` (a different
package named ``kernels`` exists on the package registry). It depends on torch and triton only.

  Topology                  blocked-CSR metadata with a transposed view (topology.py)
  Topology.for_experts      the dMoE pattern from tokens-per-expert counts, built on the device
  Topology.from_mask        any pattern, from a boolean block mask
  sdd, dsd, dds             differentiable products (functional.py)
  ops.sdd, ops.dsd, ops.dds the same products without autograd (ops.py)
  reference                 pure-torch versions of every op (reference.py)
  permute, permute_rows     fused Triton permutation into / out of the expert-grouped, block-padded
  unpermute_rows            buffer, routing positions on the device (permute.py, permute_functional.py;
                            references in permute_reference.py)
  activation                GELU / SwiGLU on sparse data over the existing blocks (activation.py)
  regroup                   sum_m S_m^T @ B_m over micro-batches as one product, rows regrouped by
                            expert (regroup.py): weight gradients accumulated once per step

See README.md in this folder for an example.
"""
from . import activation, ops, permute, permute_reference, reference, regroup
from .functional import dds, dsd, sdd
from .permute_functional import permute as permute_rows, unpermute as unpermute_rows
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
    "permute",
    "permute_reference",
    "permute_rows",
    "unpermute_rows",
    "activation",
    "regroup",
    "SddConfig",
    "DsdConfig",
]
