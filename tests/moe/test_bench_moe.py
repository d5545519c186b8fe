"""tools/bench_moe.py runs every backend at toy size on CPU (kernels under Triton's interpreter) and
writes its JSON, table and chart."""
import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_moe_reports_every_backend(tmp_path):
    bench = _load()
    out, png = tmp_path / "moe.json", tmp_path / "moe.png"
    bench.main(["--device", "cpu", "--toy", "--cases", "toy-top2", "--skew", "1.0",
                "--out", str(out), "--png", str(png)])
    data = json.loads(out.read_text())
    rows = {r["backend"]: r for r in data["results"]}
    assert list(rows) == bench.BACKENDS
    T, d, f, E, k = bench.TOY_CASES["toy-top2"]
    for r in rows.values():
        assert r["case"] == "toy-top2" and r["ms"] > 0
        assert abs(r["tflops"] - 12 * T * k * d * f / (r["ms"] * 1e-3) / 1e12) < 1e-9 * r["tflops"] + 1e-15
        assert abs(r["x_dense"] - r["tflops"] / rows["dense-equiv"]["tflops"]) < 1e-9
    assert rows["sparse"]["expert_backend"] == "sparse" and rows["grouped"]["expert_backend"] == "grouped"
    assert rows["capacity-1.0"]["capacity_factor"] == 1.0
    # the skewed router favours expert 0: its load is well above the mean
    assert rows["sparse"]["load_max_over_mean"] > 1.5
    assert "| toy-top2 |" in data["table"] and png.stat().st_size > 1000
    assert data["meta"]["activation"] == "gelu" and data["meta"]["skew"] == 1.0


def test_bench_moe_refuses_unknown_names():
    import pytest

    bench = _load()
    for argv in (["--cases", "nope"], ["--backends", "sparse,magic"], ["--device", "cpu"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_bench_moe_memory_optimized_reaches_the_layer(tmp_path):
    import torch

    bench = _load()
    case = bench.TOY_CASES["toy-top2"]
    for flag in (False, True):
        _, _, _, layer, _ = bench.moe_step(case, "sparse", False, 0.0, torch.float32, torch.device("cpu"), 16,
                                           memory_optimized=flag)
        assert layer.options.memory_optimized is flag
    out = tmp_path / "moe.json"
    bench.main(["--device", "cpu", "--toy", "--cases", "toy-top2", "--backends", "sparse,dense-equiv",
                "--memory-optimized", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["memory_optimized"] is True
    assert [r["backend"] for r in data["results"]] == ["sparse", "dense-equiv"]
