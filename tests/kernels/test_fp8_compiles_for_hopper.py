"""The fp8 products' TMA kernels compile for Hopper (sm_90) on a machine without a GPU
(hopper_compile.py): the dense one with b in either layout, and the block-sparse SDD and DSD. Their
products are fp8 wgmma, their operands come by TMA, their K loops are software-pipelined (shared
memory for several stages, where the dense pointer kernel holds one), each fits the 227 KB of
shared memory per block, and none spills registers."""
import pytest

from hopper_compile import SHARED_LIMIT, compile_for_hopper, spill_bytes

COMPILE = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dmoe_kernels.fp8 import kernels as dense, ops
from dmoe_kernels.products import fp8_ops
from dmoe_kernels.products.kernels import sparse_fp8 as sparse

kind, T, BS = sys.argv[1], 128, 128
if kind in ("k-major", "row-major"):  # the dense product, b in either layout
    BM, BN = ops.TMA_BLOCK_M, ops.TMA_BLOCK_N
    kernel, stages, stage, warps = dense.matmul_tma_kernel, ops.TMA_STAGES, (BM + BN) * T, ops.TMA_WARPS
    sig = {"a_desc": f"tensordesc<fp8e4nv[{BM}, {T}]>",
           "b_desc": f"tensordesc<fp8e4nv[{BN}, {T}]>" if kind == "k-major" else f"tensordesc<fp8e4nv[{T}, {BN}]>",
           "c_desc": f"tensordesc<bf16[{BM}, {BN}]>", "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "stride_asm": "i32", "stride_ask": "i32", "stride_bsk": "i32",
           "stride_bsn": "i32"}
    const = {"B_KMAJOR": kind == "k-major", "B_GROUP_N": 128, "OUT_DTYPE": tl.bfloat16, "OUT_BF16": True,
             "IMPRECISE_ACC": T, "BLOCK_M": BM, "BLOCK_N": BN, "TILE": T, "GROUP_M": ops.TMA_GROUP_M,
             "NUM_STAGES": ops.TMA_STAGES}
elif kind == "sdd":
    cfg = fp8_ops.SDD_CONFIG
    NB, stages, warps, SUB = cfg.width, cfg.stages, cfg.warps, BS // cfg.split
    kernel, stage = sparse.sdd_fp8_kernel, (SUB + NB * BS) * T
    sig = {"a_desc": f"tensordesc<fp8e4nv[{SUB}, {T}]>", "b_desc": f"tensordesc<fp8e4nv[{NB * BS}, {T}]>",
           "out_desc": f"tensordesc<bf16[{SUB}, {BS}]>", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
           "column_indices_ptr": "*i32", "nnz_ptr": "*i32", "K": "i32", "blocks_per_row": "i32",
           "num_programs": "i32", "stride_asr": "i32", "stride_ask": "i32", "stride_bs": "i32"}
    const = {"BS": BS, "NB": NB, "SPLIT": cfg.split, "TILE": T, "GROUP_M": 8, "FLATTEN": True,
             "OUT_DTYPE": tl.bfloat16, "IMPRECISE_ACC": T}
else:  # dsd, b K-major (the weight's quantized transpose) or row-major
    cfg = fp8_ops.DSD_CONFIG
    BN, stages, warps, SUB, kmajor = cfg.width, cfg.stages, cfg.warps, BS // cfg.split, kind == "dsd-k-major"
    kernel, stage = sparse.dsd_fp8_kernel, (SUB + BN) * BS
    sig = {"s_desc": f"tensordesc<fp8e4nv[{SUB}, {BS}]>",
           "b_desc": f"tensordesc<fp8e4nv[{BN}, {BS}]>" if kmajor else f"tensordesc<fp8e4nv[{BS}, {BN}]>",
           "c_desc": f"tensordesc<bf16[{SUB}, {BN}]>", "s_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
           "column_indices_ptr": "*i32", "nnz_ptr": "*i32", "N": "i32", "out_block_rows": "i32",
           "blocks_per_row": "i32", "num_programs": "i32", "stride_bsk": "i32", "stride_bsn": "i32"}
    const = {"BS": BS, "BLOCK_N": BN, "SPLIT": cfg.split, "B_KMAJOR": kmajor, "TILE": T, "GROUP_M": 8,
             "OUT_DTYPE": tl.bfloat16, "IMPRECISE_ACC": T}
sig.update({key: "constexpr" for key in const})
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})
ptx = compiled.asm["ptx"]
print(json.dumps({"shared": compiled.metadata.shared, "stage": stage, "stages": stages, "ptx": ptx,
                  "wgmma_e4m3": sum("wgmma.mma_async" in line and "e4m3" in line for line in ptx.splitlines()),
                  "tma_loads": ptx.count("cp.async.bulk.tensor")}))
"""


@pytest.mark.parametrize("kind", ["k-major", "row-major", "sdd", "dsd-k-major", "dsd-row-major"],
                         ids=["dense-b-k-major", "dense-b-row-major", "sparse-sdd", "sparse-dsd-b-k-major",
                              "sparse-dsd-b-row-major"])
def test_fp8_products_compile_for_hopper(kind):
    pytest.importorskip("triton")
    result = compile_for_hopper(COMPILE, kind)
    assert result["wgmma_e4m3"] > 0
    assert result["tma_loads"] > 0
    # every stage's operand tiles in shared memory at once: the loop is pipelined
    assert result["stages"] * result["stage"] <= result["shared"] <= SHARED_LIMIT
    # the promotion holds the step's product beside the accumulator: spilled registers there cost
    # the sparse products half their speed (docs/kernels.md, "Block-scaled fp8 products")
    assert spill_bytes(result["ptx"]) == 0
