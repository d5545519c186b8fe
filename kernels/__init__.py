"""dmoe_kernels: block-sparse matrix products in Triton for dropless Mixture-of-Experts.

The folder is ``kernels/`` in the repository; it is imported as ``dmoe_kernels`` (a different
package named ``kernels`` exists on the package registry). It depends on torch and triton only.

One folder per family of kernels, each laid out alike:

  <family>/kernels.py       the @triton.jit code (a kernels/ package, one module per kernel,
                            where a family has several)
  <family>/ops.py           their launchers: argument checks, configs, launches; no autograd
  <family>/functional.py    the differentiable versions (torch.autograd.Function)
  reference.py              pure-torch versions of the ops, the tests' ground truth
  launch.py                 what every launch shares: device checks, program counts, TMA readiness,
                            the direct launcher

  products/                 sdd, dsd, dds on a blocked-CSR Topology (products/topology.py, built on
                            the device for dMoE by Topology.for_experts) with tuned configs
                            (products/tuning.py)
  activations/              GELU / SwiGLU on sparse data over the existing blocks
  permutation/              tokens into / out of the expert-grouped, block-padded buffer (permute,
                            unpermute), the routing positions computed on the device, and the
                            micro-batches' rows regrouped by expert (weight gradients accumulated
                            once per step: summed_transposed_products)
  router/                   softmax top-k routing with the load-balancing loss's column sums, one
                            kernel each way (fused_route), and balance_loss from those sums
  norms/                    fused LayerNorm / RMSNorm
  loss/                     fused language-model cross-entropy
  exchange/                 rows stored into peer GPUs' symmetric memory (expert parallelism)
  fp8/                      block-scaled fp8 (e4m3) quantization and products, DeepSeek-V3's
                            recipe (import dmoe_kernels.fp8.ops, .reference or .functional)

Exported here: Topology, max_padded_rows, padded_expert_offsets, sdd, dsd, dds, permute, unpermute,
fused_route, balance_loss, SddConfig, DsdConfig, the modules reference and launch, and these names
for the families' launcher modules: ops (products.ops), activation (activations.ops), permute_ops
(permutation.ops), router_ops (router.ops).

See README.md in this folder for an example.
"""
from . import launch, reference
from .activations import ops as activation
from .permutation import ops as permute_ops
from .permutation.functional import permute, unpermute
from .products import ops
from .products.functional import dds, dsd, sdd
from .products.topology import Topology, max_padded_rows, padded_expert_offsets
from .products.tuning import DsdConfig, SddConfig
from .router import ops as router_ops
from .router.functional import balance_loss, fused_route

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
    "permute",
    "unpermute",
    "activation",
    "launch",
    "router_ops",
    "fused_route",
    "balance_loss",
    "SddConfig",
    "DsdConfig",
]
