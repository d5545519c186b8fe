"""tools/bench_kernels.py needs a GPU to time anything; on CPU its case checks and the expert-MLP
totals (how often a step runs each product, per activation) are checked."""
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # it imports the case table from tools/bench_moe.py
    spec = importlib.util.spec_from_file_location("bench_kernels", TOOLS / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_moe", None)


def _result(ms):
    T, d, f, E, k = 64, 32, 48, 8, 4
    products = {p: {"default": {"ms": ms[p]}, "best": {"ms": ms[p] / 2}, "dense_ms": 1.0, "bmm_ms": 2.0}
                for p in ms}
    return {"case": "c", "T": T, "d": d, "f": f, "experts": E, "top_k": k, "products": products}


def test_expert_mlp_totals_count_swiglu_as_nine_products(bench):
    ms = dict(zip(bench.PRODUCTS, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)))  # fwd_sdd .. bwd_dw1
    useful = 2.0 * 64 * 4 * 32 * 48
    gelu = bench.expert_mlp_totals(_result(ms), "gelu")
    assert gelu["flops"] == 6 * useful and gelu["default_ms"] == 21.0 and gelu["dense_ms"] == 6.0
    swiglu = bench.expert_mlp_totals(_result(ms), "swiglu")
    # fwd_sdd, bwd_dx and bwd_dw1 again for v1: 21 + 1 + 5 + 6
    assert swiglu["flops"] == 9 * useful and swiglu["default_ms"] == 33.0 and swiglu["bmm_ms"] == 18.0
    assert swiglu["best_ms"] == 16.5
    assert abs(swiglu["default_tflops"] - 9 * useful / 33e-3 / 1e12) < 1e-12
    # a product without a time leaves that total out rather than counting it as free
    broken = _result(ms)
    broken["products"]["bwd_dx"]["default"] = None
    assert "default_ms" not in bench.expert_mlp_totals(broken, "gelu")


def test_table_has_the_expert_mlp_row(bench):
    import io

    result = _result(dict.fromkeys(bench.PRODUCTS, 1.0))
    for p in result["products"].values():
        p["default"]["tflops"], p["best"]["tflops"], p["dense_tflops"], p["bmm_tflops"] = 2.0, 4.0, 4.0, 1.0
    result["mlp"] = bench.expert_mlp_totals(result, "swiglu")
    out = io.StringIO()
    bench.print_table([result], out=out)
    mlp = [line.split() for line in out.getvalue().splitlines() if line.startswith("c ")][-1]
    # ours 9 ms against dense 9 ms and bmm 18 ms: ratio 1, bmm / dense 0.5
    assert mlp[1] == "mlp-swiglu" and mlp[6:] == ["1.000", "2.000", "0.500"]


def test_fine_grained_case_fills_whole_blocks(bench, monkeypatch):
    assert bench.CASES["deepseek-v2-lite"] == (16384, 2048, 1408, 64, 6)
    assert bench.case_activation("deepseek-v2-lite", False) == "swiglu"
    for bs in (64, 128):  # 1408 = 11 * 128; 16384 * 6 / 64 = 1536 tokens per expert = 12 * 128
        bench.check_case("deepseek-v2-lite", bs)
    monkeypatch.setitem(bench.CASES, "odd", (100, 64, 1408, 64, 6))
    with pytest.raises(SystemExit, match="odd"):
        bench.check_case("odd", 128)
    # a case that cannot run is refused before anything else, GPU or not
    with pytest.raises(SystemExit, match="odd"):
        bench.main(["--cases", "odd"])
