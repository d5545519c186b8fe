"""A run names its directory, device, data and model size first, then shows a line at its first
step whatever the log interval; the console's imbalance says it is the maximum over layers."""
from megatron_dmoe.training.metrics_log import format_log_line
from train_helpers import small_args, snapshot


def test_first_lines_and_a_first_step_line(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    result = cli_run(run, *small_args(corpus_cache, 2, "logging.log_interval=100"))
    assert result.returncode == 0, result.stderr[-3000:]
    # training.cuda_graphs: auto resolves once, to false here without a note (no CUDA, nothing to
    # miss); config.yaml records it
    assert "cuda_graphs" not in result.stdout
    assert "  cuda_graphs: false\n" in (run / "config.yaml").read_text()
    lines = result.stdout.splitlines()
    assert lines[0] == f"run directory: {run}"
    assert lines[1] == "device: cpu, 1 process (gloo), fp32"
    assert lines[2].startswith("data: built-in corpus") and "sequences of 64 tokens" in lines[2]
    # 2 layers x 64, 4 experts of 64 -> 128 -> 64 (GELU) with top-2: half the expert weights active
    assert lines[3].startswith("model: ") and "parameters" in lines[3] and "active per token" in lines[3]
    assert lines[4] == "training: steps 1 to 2, 512 tokens per step, a log line after step 1, then every 100 steps"
    assert lines[5].startswith("step 1/2 | loss ")
    assert "(max of 2 layers)" in lines[5]
    assert set(snapshot(run)) >= {"config.yaml", "metrics.jsonl", "checkpoints/latest"}


def test_parameter_counts_match_the_model(cpu_dist):
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.model.gpt import build_gpt_model
    from megatron_dmoe.training.setup import parameter_counts

    cfg = resolve(load_config(None, ["model.hidden_size=64", "moe.num_experts=4", "moe.top_k=1",
                                     "moe.ffn_hidden_size=128", "model.num_layers=2"]))
    model = build_gpt_model(cfg, vocab_size=1000, on_cuda=False)
    total, active = parameter_counts(model, cfg, cpu_dist.device)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert expert == 2 * 4 * 2 * 64 * 128  # 2 layers, 4 experts, fc1 and fc2 without biases
    assert total == sum(p.numel() for p in model.parameters())
    assert active == total - expert + expert // 4


def test_the_console_imbalance_is_labelled_as_the_maximum_over_layers():
    line = format_log_line({"step": 3, "expert_load_imbalance": [1.2, 1.75, None, 1.1]})
    assert line == "step 3 | imbalance 1.75 (max of 3 layers)"


def test_a_progress_bar_is_named_and_keep_last_tells_what_it_deletes(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    result = cli_run(run, *small_args(corpus_cache, 3, "logging.progress_bar=on", "checkpoint.save_interval=1",
                                      "checkpoint.keep_last=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    # the bar redraws itself with carriage returns on the same stream: a line is what follows the last
    lines = [line.rsplit("\r", 1)[-1] for line in result.stdout.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert ("training: steps 1 to 3, 512 tokens per step, a progress bar (metrics.jsonl logs step 1, then every "
            "1 step)") in lines
    checkpoints = run / "checkpoints"
    after = lines.index(f"saved checkpoint {checkpoints / 'iter_0000003'}") + 1
    assert lines[after] == (f"deleted checkpoint {checkpoints / 'iter_0000001'} (checkpoint.keep_last=2 keeps the "
                            "newest 2; 0 keeps all)")
    assert sum(line.startswith("deleted checkpoint") for line in lines) == 1
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
