"""tools/bench_fp8.py runs its tiny shapes on CPU (Triton's interpreter, the Triton rows) and writes
its rows; on a GPU, small shapes with every row (cuBLAS's bf16 and _scaled_mm too)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_fp8.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_fp8", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


# with CUDA, this process's triton compiles (tests/conftest.py sets the interpreter only without it)
@pytest.mark.skipif(torch.cuda.is_available(), reason="--toy needs Triton's interpreter in this process")
def test_bench_fp8_toy_writes_checked_rows(tmp_path, capsys):
    bench = _tool()
    out = tmp_path / "fp8.json"
    assert bench.main(["--toy", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [
        (shape, impl) for shape in bench.TOY_SHAPES for impl in ("fp8", "fp8_pointers", "fp8+quant")]
    assert result["max_rel_error_bound"] == bench.MAX_REL_ERROR
    for r in rows:
        assert (r["m"], r["n"], r["k"], r["kind"]) == bench.TOY_SHAPES[r["shape"]]
        assert r["ok"] is True and 0 <= r["max_rel_error"] <= bench.MAX_REL_ERROR
        assert r["ms"] > 0 and r["tflops"] > 0 and r["speedup_vs_bf16"] is None
    table = capsys.readouterr().out
    assert "toy: Triton rows only (no cuBLAS or _scaled_mm on CPU)" in table
    for r in rows:
        assert any(r["shape"] in line and r["label"] in line for line in table.splitlines())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_fp8_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="bench_fp8: needs a CUDA GPU"):
        _tool().main([])


@pytest.mark.gpu
def test_bench_fp8_on_gpu_times_every_row(tmp_path):
    """128 x 128 scales with K/128 = 6 (not a multiple of 4: the layouts torch versions differ on)."""
    bench = _tool()
    out = tmp_path / "fp8.json"
    assert bench.main(["--shapes", "256x384x768,384x256x512:wgrad", "--rep-ms", "5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    common = ["bf16", "fp8", "fp8_pointers", "fp8+quant", "scaled_mm"]
    assert [r["impl"] for r in rows] == common + ["scaled_mm_w_rows"] + common  # the forward's W in rows too
    for r in rows:
        if r["impl"].startswith("scaled_mm") and r["ms"] is None:
            assert r["note"].startswith("not supported here: ")
            continue
        assert r["ms"] > 0 and r["ok"] is not False
