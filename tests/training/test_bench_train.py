"""tools/bench_train.py runs its three models end to end (on CPU at toy size) and writes its JSON."""
import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_train.py"


def test_bench_train_reports_every_model(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main([
        "--device", "cpu", "--precision", "fp32", "--steps", "2", "--warmup", "1",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32", "--vocab-size", "300", "--out", str(out),
        "--set", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.ffn_hidden_size=64", "moe.ffn_hidden_size=64",
    ])
    results = json.loads(out.read_text())["results"]
    assert [r["model"] for r in results] == ["dense", "dmoe", "capacity"]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["final_loss"] > 0
    # the dMoE has 64 experts of the dense width: more parameters, same active FLOPs per token
    assert results[1]["params"] > results[0]["params"]
    assert results[1]["tflops_per_gpu"] / results[1]["tokens_per_s"] > 0.99 * (
        results[0]["tflops_per_gpu"] / results[0]["tokens_per_s"])
