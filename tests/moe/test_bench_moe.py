"""tools/bench_moe.py runs every backend at toy size on CPU (kernels under Triton's interpreter) and
writes its JSON, table and chart."""
import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_moe_fp8_rows_beside_bf16(tmp_path):
    """--backends sparse-fp8 (named, not by default): the layer with training.fp8's products, checked
    against grouped within fp8's error before it is timed, and its ratio to the bf16 sparse layer."""
    bench = _load()
    out = tmp_path / "moe.json"
    bench.main(["--device", "cpu", "--toy", "--cases", "toy-top1", "--backends", "sparse,sparse-fp8,grouped",
                "--rep-ms", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["backend"]: r for r in data["results"]}
    assert list(rows) == ["sparse", "sparse-fp8", "grouped"] and "sparse-fp8" not in bench.BACKENDS
    assert rows["sparse-fp8"]["expert_backend"] == "sparse" and rows["sparse-fp8"]["ms"] > 0
    ratio = rows["sparse-fp8"]["tflops"] / rows["sparse"]["tflops"]
    assert "fp8 / bf16 sparse" in data["table"] and f"| {ratio:.2f} |" in data["table"]


def test_bench_moe_refuses_unknown_names():
    import pytest

    bench = _load()
    for argv in (["--cases", "nope"], ["--backends", "sparse,magic"], ["--device", "cpu"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_moe_case_with_its_own_activation_and_skewed_routing_beside_balanced(tmp_path):
    """toy-fine (a small deepseek-v2-lite) is SwiGLU without --swiglu, counted 18*T*k*d*f; --skew 2
    runs each case balanced and skewed, dense-equiv once, and rows carry skew and load."""
    bench = _load()
    out = tmp_path / "moe.json"
    bench.main(["--device", "cpu", "--toy", "--cases", "toy-top1,toy-fine", "--backends", "grouped,dense-equiv",
                "--skew", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["cases"]["toy-fine"]["activation"] == "swiglu" and data["cases"]["toy-top1"]["activation"] == "gelu"
    assert data["meta"]["activation"] == "gelu"  # the flag's, for the cases without their own
    rows = {(r["case"], r["backend"], r["skew"]): r for r in data["results"]}
    assert list(rows) == [(c, b, s) for c in ("toy-top1", "toy-fine")
                          for b, s in (("grouped", 0.0), ("dense-equiv", 0.0), ("grouped", 2.0))]
    for (case, backend, skew), r in rows.items():
        T, d, f, E, k = bench.TOY_CASES[case]
        per_token = 18 if case == "toy-fine" else 12
        assert r["activation"] == ("swiglu" if case == "toy-fine" else "gelu")
        assert abs(r["tflops"] - per_token * T * k * d * f / (r["ms"] * 1e-3) / 1e12) < 1e-9 * r["tflops"]
        # skewed rows against the balanced dense-equiv and the balanced run of their backend
        assert abs(r["x_dense"] - r["tflops"] / rows[(case, "dense-equiv", 0.0)]["tflops"]) < 1e-9 * r["x_dense"]
        if skew:
            balanced = rows[(case, backend, 0.0)]
            assert abs(r["x_balanced"] - r["tflops"] / balanced["tflops"]) < 1e-9 * r["x_balanced"]
            assert r["load_max_over_mean"] > balanced["load_max_over_mean"]
    head = data["table"].splitlines()[0]
    assert "grouped skew 2 TFLOP/s" in head and "load max/mean skew 2" in head
    assert "dense-equiv skew" not in head


def test_bench_moe_table_skewed_columns():
    bench = _load()

    def row(backend, skew, tflops, load=None, **extra):
        r = dict(case="c", backend=backend, skew=skew, tflops=tflops, act_mem_bytes=None, **extra)
        if load is not None:
            r["load_max_over_mean"] = load
        return r

    balanced = [row("sparse", 0.0, 300.0, 1.3), row("dense-equiv", 0.0, 600.0)]
    skewed = [row("sparse", 2.0, 150.0, 7.5, x_balanced=0.5)]
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    head, _, line = bench.summary_table(balanced + skewed, ["sparse", "dense-equiv"]).splitlines()
    assert dict(zip(cells(head), cells(line))) == {
        "case": "c", "sparse TFLOP/s": "300", "dense-equiv TFLOP/s": "600", "sparse / dense": "0.50",
        "sparse mem / dense mem": "-", "sparse padded rows / routed": "-",
        "sparse skew 2 TFLOP/s": "150", "sparse skewed / balanced": "0.50",
        "load max/mean balanced": "1.30", "load max/mean skew 2": "7.50"}
    # --skew 0: the balanced table alone, as before
    assert "skew" not in bench.summary_table(balanced, ["sparse", "dense-equiv"])


def test_bench_moe_fine_grained_case_and_activation_choice():
    import pytest

    bench = _load()
    assert bench.CASES["deepseek-v2-lite"] == (16384, 2048, 1408, 64, 6)
    assert bench.case_activation("deepseek-v2-lite", swiglu=False) == "swiglu"
    assert bench.case_activation("olmoe", swiglu=False) == "gelu"
    assert bench.case_activation("olmoe", swiglu=True) == "swiglu"
    assert bench.useful_flops(bench.CASES["deepseek-v2-lite"], True) == 18 * 16384 * 6 * 2048 * 1408
    with pytest.raises(SystemExit):
        bench.parse_args(["--skew", "-1"])


@pytest.mark.slow
def test_bench_moe_router_choice_reaches_the_layers(tmp_path):
    """--router torch|fused|auto sets the MoE backends' router; rows say which path ran (auto on CPU:
    torch; fused: the kernels under Triton's interpreter)."""
    import pytest

    bench = _load()
    for choice, path in (("fused", "fused"), ("torch", "torch"), ("auto", "torch")):
        out = tmp_path / f"{choice}.json"
        bench.main(["--device", "cpu", "--toy", "--cases", "toy-top1", "--backends", "grouped,capacity-1.0",
                    "--router", choice, "--out", str(out)])
        data = json.loads(out.read_text())
        assert data["meta"]["router"] == choice
        assert [r["router"] for r in data["results"]] == [path, path]
    with pytest.raises(SystemExit):
        bench.parse_args(["--router", "magic"])


def test_bench_moe_even_routing_fills_every_block():
    """--even-routing gives every expert T*k/E tokens: no padding rows at a block size dividing
    that, where the fresh router's routing pads; and it refuses --skew beside it."""
    import pytest
    import torch

    bench = _load()
    case = bench.TOY_CASES["toy-fine"]  # 64 tokens, 8 experts, top-4: 32 rows per expert
    stats = {}
    for even in (False, True):
        _, _, _, layer, x = bench.moe_step(case, "sparse", True, 0.0, torch.float32, torch.device("cpu"), 16,
                                           even=even)
        stats[even] = bench.routing_stats(layer, x, 16)
    assert stats[True]["load_max_over_mean"] == 1.0 and stats[True]["padded_rows_x"] == 1.0
    assert stats[False]["padded_rows_x"] > 1.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--even-routing", "--skew", "1", "--device", "cpu", "--toy"])


def test_ep8_cases_are_the_paper_models_per_gpu_part():
    """paper-*-ep8: what one GPU of the paper's models computes under expert parallelism 8, 8 local
    experts of the same width receiving 2048 routed rows each."""
    bench = _load()
    for name in ("paper-small", "paper-medium"):
        T, d, f, E, k = bench.CASES[name]
        T8, d8, f8, E8, k8 = bench.CASES[name + "-ep8"]
        assert (d8, f8, k8) == (d, f, k) == (d, f, 1) and E8 == 8
        assert T8 * k8 // E8 == 2048 and T8 == 16384
