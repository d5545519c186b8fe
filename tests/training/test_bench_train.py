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
        "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32", "--vocab-size", "300",
        "--out", str(out),
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


def _load():
    spec = importlib.util.spec_from_file_location("bench_train", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _two_dmoe_runs(tmp_path, models, *extra):
    """Two dMoE models on the sparse experts (interpreter), two micro-batches per step, two steps,
    both in this process (numerics, not isolation, are checked here): their result rows."""
    out = tmp_path / "bench.json"
    _load().main([
        "--device", "cpu", "--precision", "fp32", "--steps", "2", "--warmup", "0", "--models", models, *extra,
        "--in-process",
        # 16 tokens a sequence: the interpreter runs a program per token in the permutations
        "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16", "--vocab-size", "300",
        "--out", str(out),
        "--set", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.ffn_hidden_size=64", "moe.ffn_hidden_size=64", "moe.num_experts=8", "moe.backend=sparse",
        "moe.block_size=64",
    ])
    return json.loads(out.read_text())["results"]


def test_expert_gradients_once_per_step_train_like_once_per_micro_batch(tmp_path):
    """The loss after an update is the same whether the experts' weight gradients were added per
    micro-batch or once at the end of the step, so the deferred gradients reached the optimizer."""
    per_micro_batch, per_step = _two_dmoe_runs(tmp_path, "dmoe,dmoe-per-step")
    assert per_step["model"] == "dmoe-per-step"
    assert abs(per_step["final_loss"] - per_micro_batch["final_loss"]) < 1e-5 * per_micro_batch["final_loss"]


def test_expert_gradients_once_per_window_train_like_once_per_micro_batch(tmp_path, monkeypatch):
    """As above with a window of two micro-batches (moe.expert_wgrad_window, the form captured layers
    hold; dmoe-window is dmoe-balanced with it): the same loss after two updates, and every expert
    weight's gradient went through a window."""
    from dmoe_kernels.products.window import WindowSlots

    calls = []
    add = WindowSlots.add
    monkeypatch.setattr(WindowSlots, "add", lambda self, *a: (calls.append(self.window), add(self, *a))[1])
    per_micro_batch, windowed = _two_dmoe_runs(tmp_path, "dmoe-balanced,dmoe-window", "--wgrad-window", "2")
    assert windowed["model"] == "dmoe-window"
    # 2 layers x 2 weights (GELU) x 2 micro-batches x 2 steps
    assert calls == [2] * 16
    assert abs(windowed["final_loss"] - per_micro_batch["final_loss"]) < 1e-5 * per_micro_batch["final_loss"]

TOY = ["--device", "cpu", "--precision", "fp32", "--steps", "1", "--warmup", "0",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32", "--vocab-size", "300",
       "--set", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
       "model.ffn_hidden_size=64", "moe.ffn_hidden_size=64"]


def test_bench_train_on_two_processes_with_expert_parallel_dmoe(tmp_path, capsys):
    """--nproc-per-node 2 launches torchrun (gloo): dense and capacity data parallel, the dMoE at
    EP = 2, all on the same global batch; graphed runs (CUDA only) are rows that say why not."""
    out = tmp_path / "bench.json"
    _load().main(["--nproc-per-node", "2", "--ep", "2", "--models", "dense,dmoe,capacity", "--cuda-graphs", "both",
                  "--out", str(out), *TOY])
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["complete"] is True
    rows = {r["model"]: r for r in data["results"]}
    assert list(rows) == ["dense", "dmoe", "capacity", "dense+graphs", "dmoe+graphs", "capacity+graphs"]
    ep = {name: rows[name]["expert_model_parallel_size"] for name in ("dense", "dmoe", "capacity")}
    assert ep == {"dense": 1, "dmoe": 2, "capacity": 1}
    for name in ("dense", "dmoe", "capacity"):
        r = rows[name]
        assert r["world_size"] == 2 and r["data_parallel_size"] == 2 and r["global_batch_size"] == 4
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["final_loss"] > 0
        # per GPU: the global batch's tokens over the step time, shared by the two processes
        assert abs(r["tokens_per_s"] - 4 * 32 / (r["ms_per_step"] * 1e-3) / 2) < 1e-6 * r["tokens_per_s"]
    # the whole model is counted, not the experts one rank holds: the same as the capacity MoE's
    assert rows["dmoe"]["params"] == rows["capacity"]["params"] > rows["dense"]["params"]
    for name in ("dense+graphs", "dmoe+graphs", "capacity+graphs"):
        assert "training.cuda_graphs" in rows[name]["refused"] and "tokens_per_s" not in rows[name]
    table = capsys.readouterr().out
    assert f"{'dmoe+graphs':23s}   2 refused: " in table and "tokens/s/GPU" in table


def test_bench_train_failed_child_becomes_a_row_and_the_next_runs(capsys):
    """Each run in its own process: a run whose child fails is that run's row only; each row is
    printed and handed on as soon as its child ends."""
    bench = _load()
    args = bench.parse_args(["--models", "dense", *TOY])
    plan = bench.plan_runs(args, "cpu", world_size=1)
    rows = bench.bench_in_children(plan, ["--no-such-option"], None, on_cuda=False)
    assert [r["model"] for r in rows] == ["dense"]
    assert "--no-such-option" in rows[0]["error"] and "tokens_per_s" not in rows[0]
    # a run that fails in its child (no such config there), then one that works
    (name, graphs, cfg, _), = plan
    seen = []
    rows = bench.bench_in_children([("zoo/no_such_model", graphs, cfg, None), plan[0]], TOY, None, on_cuda=False,
                                   finished=lambda so_far: seen.append([r["model"] for r in so_far]))
    assert [r["model"] for r in rows] == ["zoo/no_such_model", "dense"]
    assert "no_such_model" in rows[0]["error"] and "tokens_per_s" not in rows[0]
    assert rows[1]["tokens_per_s"] > 0 and "error" not in rows[1]
    assert seen == [["zoo/no_such_model"], ["zoo/no_such_model", "dense"]]
    out = capsys.readouterr().out
    assert "bench_train: zoo/no_such_model done: failed" in out
    assert f"bench_train: dense done: {rows[1]['ms_per_step']:.1f} ms a step, {rows[1]['tokens_per_s']:,.0f}" in out


def test_out_of_memory_is_named_with_the_allocation_torch_asked_for():
    bench = _load()
    output = ("Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
              "allocate 3.91 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is free.\n")
    row = bench.failure_row({"model": "dmoe"}, 1, output)
    assert row["oom"] and row["oom_requested"] == "3.91 GiB"
    assert row["reason"] == "CUDA out of memory (tried to allocate 3.91 GiB)"
    assert "failed" not in bench.failure_row({"model": "x"}, 1, "ValueError: no")  # no reason made up
    assert "reason" not in bench.failure_row({"model": "x"}, 1, "ValueError: no")


def test_zoo_mode_runs_the_shipped_configs(tmp_path):
    """--zoo: each model's config is the shipped one (its batch, precision, defaults) on this device;
    on CPU at toy size (--set) the runs train, each in its own process, and auto graphs are off."""
    from megatron_dmoe.config import load_config, resolve

    bench = _load()
    args = bench.parse_args(["--zoo", "--device", "cpu"])
    assert args.cuda_graphs == "auto"
    assert args.models.split(",") == [m for m in bench.ZOO_MODELS if m not in bench.ZOO_NOT_BY_DEFAULT]
    for name, (config, extra) in bench.ZOO_MODELS.items():
        cfg = bench.model_config(name, args, "cuda", None)
        assert cfg == resolve(load_config(config, ["training.device=cuda", *extra])), name
    shipped = resolve(load_config("zoo/dmoe_small"))
    eight = bench.model_config("zoo-dmoe-8x", args, "cuda", None)
    assert eight.moe.num_experts == 8 and shipped.moe.num_experts == 64
    assert eight.training.global_batch_size == shipped.training.global_batch_size
    # the zoo's tokens come from its own tokenizer's vocabulary, the other models' from GPT-2's
    assert bench.vocab_size(args, shipped) == shipped.data.builtin_vocab_size != bench.DEFAULT_VOCAB
    assert bench.vocab_size(bench.parse_args([]), shipped) == bench.DEFAULT_VOCAB
    assert bench.vocab_size(bench.parse_args(["--zoo", "--vocab-size", "300"]), shipped) == 300
    for argv in (["--zoo", "--models", "dense"], ["--zoo", "--ep", "8"]):
        try:
            bench.parse_args(argv)
        except SystemExit:
            continue
        raise AssertionError(f"{argv} was accepted")

    out = tmp_path / "zoo.json"
    bench.main(["--zoo", "--models", "zoo-dense,zoo-dmoe-8x", "--device", "cpu", "--steps", "1", "--warmup", "0",
                "--vocab-size", "300", "--out", str(out), "--set", "model.num_layers=4", "model.hidden_size=32",
                "model.num_attention_heads=4", "model.ffn_hidden_size=64", "moe.ffn_hidden_size=64",
                "training.bf16=false", "training.micro_batch_size=2", "training.global_batch_size=4",
                "model.seq_length=32"])
    rows = json.loads(out.read_text())["results"]
    assert [r["model"] for r in rows] == ["zoo-dense", "zoo-dmoe-8x"]
    assert all(r["tokens_per_s"] > 0 and r["cuda_graphs"] is False and r["global_batch_size"] == 4 for r in rows)


def test_bench_train_checks_its_process_counts(monkeypatch):
    import pytest

    bench = _load()
    for argv in (["--ep", "0"], ["--nproc-per-node", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    monkeypatch.setenv("WORLD_SIZE", "2")  # started by torchrun: it must not launch torchrun again
    with pytest.raises(SystemExit):
        bench.parse_args(["--nproc-per-node", "2"])
    bench.parse_args(["--nproc-per-node", "2", "--in-process"])  # a launched child


def test_a_child_that_hangs_after_writing_its_rows_is_killed_and_its_rows_kept(tmp_path, monkeypatch):
    """A launch whose process-group teardown hangs after it wrote its rows is killed after the grace
    period; what it measured is kept."""
    import sys

    bench = _load()
    monkeypatch.setattr(bench, "TEARDOWN_GRACE_S", 1)
    rows = tmp_path / "rows.json"
    child = [sys.executable, "-c", f"import time; open({str(rows)!r}, 'w').write('{{}}'); print('ran', flush=True); "
                                   "time.sleep(600)"]
    done = bench._run_child(child, {}, str(rows), str(tmp_path / "out.txt"))
    assert done.teardown_hung and done.returncode != 0 and "ran" in done.stdout
    quick = bench._run_child([sys.executable, "-c", "print('done')"], {}, str(tmp_path / "none.json"),
                             str(tmp_path / "out2.txt"))
    assert not quick.teardown_hung and quick.returncode == 0 and quick.stdout.strip() == "done"
