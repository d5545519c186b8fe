"""Block-scaled fp8 (e4m3) quantization and matrix products, DeepSeek-V3's recipe: 1 x 128 tiles on
activations and gradients, 128 x 128 blocks on weights, fp32 accumulation promoted every 128 of K.

  reference.py    pure torch: quantize_rows, quantize_blocks, their dequantization, matmul
  kernels.py      the @triton.jit code (their tests run on CPU through Triton's interpreter)
  ops.py          launchers of the Triton kernels (same signatures as reference.py)
  cublas.py       the same products through torch._scaled_mm, where cuBLAS takes the block scales
  functional.py   linear: y = x W^T with its input and weight gradients through fp8 products
"""
