"""Bad input fails before training with one clear message, and damages nothing."""
import numpy as np
import pytest

from train_helpers import SMALL


@pytest.fixture
def run_train(cli_run):
    return cli_run


def _assert_clean_failure(result, *needles):
    assert result.returncode == 2, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr[-3000:])


def test_config_errors_are_all_reported_without_traceback(run_train, tmp_path):
    result = run_train(tmp_path / "run", "moe.top_k=9", "model.hiden_size=64")
    _assert_clean_failure(result, "model.hiden_size", "did you mean model.hidden_size")
    result = run_train(tmp_path / "run", "moe.top_k=9", "model.num_attention_heads=3")
    _assert_clean_failure(result, "moe.top_k", "model.num_attention_heads")
    assert not (tmp_path / "run").exists()


def test_missing_data_file_fails_before_training(run_train, tmp_path):
    tok = tmp_path / "missing.model"
    result = run_train(
        tmp_path / "run", f"data.data_path=[{tmp_path}/nothing_text_document]", f"data.tokenizer_model={tok}"
    )
    _assert_clean_failure(result, "missing.model")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_corrupt_index_and_small_vocabulary_fail_clearly(run_train, tmp_path, corpus_cache):
    from megatron_dmoe.data import prepare_builtin_corpus

    prefix, tokenizer = prepare_builtin_corpus(4096, corpus_cache)
    broken = tmp_path / "broken_text_document"
    (tmp_path / "broken_text_document.bin").write_bytes(open(prefix + ".bin", "rb").read()[:1000])
    (tmp_path / "broken_text_document.idx").write_bytes(np.arange(50, dtype=np.int64).tobytes())
    result = run_train(tmp_path / "run", f"data.data_path=[{broken}]", f"data.tokenizer_model={tokenizer}")
    _assert_clean_failure(result, "broken_text_document.idx")

    result = run_train(
        tmp_path / "run", "model.vocab_size=100", f"data.cache_dir={corpus_cache}", *SMALL
    )
    _assert_clean_failure(result, "model.vocab_size=100", "4096")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_existing_checkpoints_are_not_overwritten_without_resume(run_train, tmp_path, corpus_cache):
    args = SMALL + ["training.train_iters=3", "training.eval_interval=0", f"data.cache_dir={corpus_cache}"]
    first = run_train(tmp_path / "run", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "run" / "checkpoints" / "latest"
    before = marker.read_text()
    again = run_train(tmp_path / "run", *args)
    _assert_clean_failure(again, "--resume")
    assert marker.read_text() == before
