"""Block-sparse products on a blocked-CSR topology: SDD, DSD, DDS and their transposed variants.

  topology.py   Topology (metadata, built on the device for dMoE) and the padded-row helpers
  tuning.py     the tile configurations (SddConfig, DsdConfig) chosen per shape and device
  kernels/      the @triton.jit code: sdd, sdd_tma (persistent, TMA, GELU epilogue), dsd, dsd_tma,
                dsdt_tma (weight gradients), tile_mapping (swizzled tile order), topology
  ops.py        launchers without autograd: sdd, sdd_gelu, dsd, dds
  functional.py autograd: sdd, dsd, dds
"""
