"""tools/step_breakdown.py: a profiled step's kernels sorted into the parts of the step."""
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "step_breakdown.py"
spec = importlib.util.spec_from_file_location("step_breakdown", TOOL)
step_breakdown = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_breakdown)


def test_kernels_fall_into_their_parts():
    expected = {
        "void c10d::symmetric_memory::barrier_kernel<(unsigned long)0>(...)": "exchange waits",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "exchange waits",
        "push_rows_kernel": "exchange rows",
        "push_copies_kernel": "exchange rows",
        "dsdt_tma_kernel": "weight gradients",
        "dsdt_window_kernel": "weight gradients",
        "copy_to_slot_kernel": "wgrad slot copies",
        "dsd_tma_kernel": "expert products",
        "sdd_tma_kernel": "expert products",
        "expand_kernel": "permutation",
        "reduce_kernel": "permutation",
        "activation_backward_kernel": "expert activation",
        "route_forward_kernel": "router",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
        "::FusedOptimizerTensorListMetadata<4>, at": "optimizer",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func": "rest",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "rest",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": "rest",
    }
    assert {name: step_breakdown.part_of(name) for name in expected} == expected


def test_parts_add_up_and_the_summary_shows_the_wgrad_rate():
    parts = step_breakdown.breakdown([("dsdt_tma_kernel", 4.0, 8), ("barrier_kernel", 1.0, 5),
                                      ("gemm", 3.0, 2), ("dsd_tma_kernel", 2.0, 4)])
    assert parts["weight gradients"] == {"ms": 4.0, "calls": 8}
    assert parts["exchange waits"] == {"ms": 1.0, "calls": 5}
    assert parts["expert products"] == {"ms": 2.0, "calls": 4}
    assert parts["rest"] == {"ms": 3.0, "calls": 2}
    assert sum(p["ms"] for p in parts.values()) == 10.0
    lines = step_breakdown.summary_lines(parts, wall_ms=20.0, wgrad_flops=2e12)
    wgrad = next(line for line in lines if "weight gradients" in line)
    assert "500 TFLOP/s useful" in wgrad and "20.0%" in wgrad  # 2e12 FLOPs in 4 ms; 4 of 20 ms
    idle = next(line for line in lines if "no kernel running" in line)
    assert "10.0" in idle and "50.0%" in idle
    assert not any("optimizer" in line for line in lines)  # parts with no kernel are left out
