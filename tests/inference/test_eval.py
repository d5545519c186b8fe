"""dmoe-eval: the run's own validation loss as logged, and a loss over given indexed datasets."""
import json
import math

from megatron_dmoe.inference.eval_cli import eval_main


def test_eval_of_the_runs_validation_split_equals_the_logged_validation_loss(runs, tmp_path, capsys):
    logged = [json.loads(line) for line in (runs["mixtral"] / "metrics.jsonl").read_text().splitlines()]
    last = [rec for rec in logged if "val_loss" in rec][-1]
    assert last["step"] == 2  # the step of the run's checkpoint
    out = tmp_path / "eval.json"
    assert eval_main([str(runs["mixtral"]), "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["loss"] == last["val_loss"]
    assert printed["perplexity"] == math.exp(last["val_loss"])
    assert printed["checkpoint_iteration"] == 2
    assert printed["tokens"] == 2 * 8 * 64  # eval_iters x global batch x sequence


def test_eval_over_indexed_datasets_reads_every_full_micro_batch(runs, corpus_cache, tmp_path, capsys):
    import numpy as np

    from megatron_dmoe.data import load_tokenizer, preprocess_data
    from megatron_dmoe.data.builtin import prepare_builtin_corpus

    _, tokenizer_model = prepare_builtin_corpus(4096, corpus_cache)
    docs = tmp_path / "docs.jsonl"
    texts = ["def f(x):\n    return x * 2\n" * 30, "class A:\n    pass\n" * 40]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess_data([str(docs)], str(tmp_path / "small"), tokenizer_model, progress=False)
    tokens = sum(len(load_tokenizer(tokenizer_model).tokenize(t)) + 1 for t in texts)  # + end of document
    assert eval_main([str(runs["mixtral"]), "--device", "cpu", "--no-progress", "--micro-batch-size", "2",
                      "--data-path", str(tmp_path / "small_text_document")]) == 0
    result = json.loads(capsys.readouterr().out)
    samples = (tokens - 1) // 64  # windows of 64 inputs + 1 label
    assert result["samples"] == samples
    assert result["micro_batches"] == samples // 2
    assert result["tokens"] == samples // 2 * 2 * 64
    assert np.isfinite(result["loss"]) and result["perplexity"] == math.exp(result["loss"])
