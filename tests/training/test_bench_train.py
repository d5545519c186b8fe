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
        "--models", "dense,dmoe,capacity",  # dmoe-per-step needs the sparse experts: CUDA's default
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


def test_expert_gradients_once_per_step_train_like_once_per_micro_batch(tmp_path):
    """The dMoE twice on the sparse experts (interpreter), three micro-batches per step: the loss
    after an update is the same whether the experts' weight gradients were added per micro-batch or
    once at the end of the step, so the deferred gradients reached the optimizer."""
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main([
        "--device", "cpu", "--precision", "fp32", "--steps", "2", "--warmup", "0", "--models", "dmoe,dmoe-per-step",
        "--micro-batch-size", "2", "--global-batch-size", "6", "--seq-length", "32", "--vocab-size", "300",
        "--out", str(out),
        "--set", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.ffn_hidden_size=64", "moe.ffn_hidden_size=64", "moe.num_experts=8", "moe.backend=sparse",
        "moe.block_size=64",
    ])
    per_micro_batch, per_step = json.loads(out.read_text())["results"]
    assert per_step["model"] == "dmoe-per-step"
    assert abs(per_step["final_loss"] - per_micro_batch["final_loss"]) < 1e-5 * per_micro_batch["final_loss"]
