"""Block-sparse products on a blocked-CSR topology: SDD, DSD, DDS and their transposed variants.

  topology.py   Topology (metadata, built on the device for dMoE) and the padded-row helpers
  tuning.py     the tile configurations (SddConfig, DsdConfig) chosen per shape and device
  kernels/      the @triton.jit code: sdd, sdd_tma (persistent, TMA, GELU epilogue), dsd, dsd_tma,
                dsdt_tma (weight gradients), sparse_fp8 (block-scaled fp8 SDD and DSD),
                tile_mapping (swizzled tile order), topology
  ops.py        launchers without autograd: sdd, sdd_gelu, dsd, dds
  fp8_ops.py    the fp8 launchers: sdd_fp8, dsd_fp8, quantize_blocks_rows
  functional.py autograd: sdd, dsd, dds
"""
