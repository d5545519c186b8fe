"""The weight-gradient window's product compiles for Hopper (sm_90) with either epilogue, on a
machine without a GPU (hopper_compile.py). Checks what the interpreter cannot: that the TMA reduce
epilogue lowers to the bulk reduce-add, that the matrix products are wgmma, and that shared memory
fits an H100/H200's 227 KB per block."""
import pytest

from hopper_compile import SHARED_LIMIT, compile_for_hopper

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dmoe_kernels.products.kernels import dsdt_window as m

reduce = sys.argv[1] == "tma_reduce"
BS, BN, BK = 128, 256, 64  # the H200 config of dsd_config(128, 768, transpose=True, regular=True)
sig = {"s_desc": f"tensordesc<bf16[{BK}, {BS}]>", "b_desc": f"tensordesc<bf16[{BK}, {BN}]>",
       "offsets_ptr": "*i32", "order_ptr": "*i32", "counter_ptr": "*i32", "c_ptr": "*fp32", "stride_cm": "i32",
       "N": "i32", "num_experts": "i32", "num_programs": "i32", "slot_s_rows": "i32",
       "slot_b_rows": "i32", "s_rows": "i32", "b_rows": "i32",
       "c_desc": "tensordesc<fp32[128, 64]>" if reduce else "constexpr"}
const = {"F": 24, "W": 4, "BS": BS, "BLOCK_N": BN, "BLOCK_K": BK, "GROUP_M": 8, "DOT_PRECISION": "tf32",
         "COUNT_CHUNK": 64, "TMA_REDUCE": reduce, "STRIP": 64}
if not reduce:
    const["c_desc"] = None
sig.update({k: "constexpr" for k in const})
k = triton.compile(ASTSource(m.dsdt_window_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8, "num_stages": 3})
ptx = k.asm["ptx"]
# the copy that stashes the offsets and orders the experts for it, in both of its modes
csig = {"src_ptr": "*bf16", "dst_ptr": "*bf16", "slot_ptr": "*i32", "count_ptr": "*i32", "n_static": "i32",
        "slot_elems": "i32", "num_programs": "i32", "new_offsets_ptr": "*i32", "offsets_ptr": "*i32",
        "order_ptr": "*i32", "next_counter_ptr": "*i32", "num_experts": "i32"}
for advance in (False, True):
    cconst = {"COUNT_SCALE": 768, "HAS_COUNT": True, "BLOCK": 4096, "OFFSETS": True, "ADVANCE": advance, "W": 4,
              "BS": BS, "KSTEPS": BS // BK, "BLOCK_E": 64}
    triton.compile(ASTSource(m.copy_to_slot_kernel, {**csig, **{k: "constexpr" for k in cconst}}, cconst),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"shared": k.metadata.shared, "reduce": ptx.count("cp.reduce.async.bulk.tensor"),
                  "wgmma": ptx.count("wgmma.mma_async")}))
"""
@pytest.mark.parametrize("epilogue", ["pointers", "tma_reduce"])
def test_window_product_compiles_for_hopper(epilogue):
    pytest.importorskip("triton")
    result = compile_for_hopper(COMPILE, epilogue)
    assert result["wgmma"] > 0
    assert 0 < result["shared"] <= SHARED_LIMIT
    # four 64-column strips of the 128 x 256 tile, each one bulk reduce-add; none through pointers
    assert result["reduce"] == (4 if epilogue == "tma_reduce" else 0)
