"""tools/bench_compiled_launch.py: its split of a route's host time into a per-launch and a fixed
part, and its one-line refusal without CUDA (inductor runs user Triton kernels on CUDA only)."""
import importlib.util
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_compiled_launch.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_compiled_launch", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_launch_splits_the_full_chain_against_one_launch_each_way():
    tool = _tool()
    rows = [{"route": "a", "launches": 31, "host_us": 12.0 + 31 * 5.0},
            {"route": "a", "launches": 2, "host_us": 12.0 + 2 * 5.0},
            {"route": "b", "launches": 31, "host_us": 400.0},
            {"route": "b", "launches": 2, "host_us": None, "error": "x"}]
    got = tool.per_launch(rows, 31)
    assert set(got) == {"a"}  # a route without both sizes has no split
    slope, fixed = got["a"]
    assert slope == pytest.approx(5.0) and fixed == pytest.approx(12.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_exits_with_one_line():
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(["--calls", "1"])
    assert "needs a CUDA GPU" in str(exit_info.value)


def test_cpp_tma_boxes_are_narrowed_to_the_128_byte_span_before_encoding():
    from torch._inductor.codegen.cuda import device_op_overrides

    cls = device_op_overrides.CUDADeviceOpOverrides
    saved = cls.__dict__["tma_descriptor_helpers"]
    try:
        tool = _tool()
        tool.narrow_cpp_tma_boxes()
        tool.narrow_cpp_tma_boxes()  # once only
        text = cls().tma_descriptor_helpers()
        stable = text[text.index("static void initTMADescriptor("):]
        clamp = stable.index("blockSizeInt[0] = 128 / elemSize;")
        assert text.count("128 / elemSize;") == 1
        assert stable.index("contigDimSizeInByte = elemSize * blockSizeInt[0]") < clamp  # the swizzle is chosen first
        assert clamp < stable.index("cuTensorMapEncodeTiled(")
    finally:
        cls.tma_descriptor_helpers = saved
        if "_narrowed_tma_boxes" in cls.__dict__:
            del cls._narrowed_tma_boxes
