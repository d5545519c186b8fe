"""The built-in corpus: prepared once, reused from its cache, exact, and safe when several
processes start at once."""
import json
import multiprocessing
import os
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_dmoe.data import builtin
from megatron_dmoe.data.builtin import (
    builtin_documents,
    corpus_key,
    ensure_builtin_corpus,
    prepare_builtin_corpus,
    split_source,
    stdlib_sources,
)
from megatron_dmoe.data.sentencepiece_tokenizer import SentencePieceTokenizer, load_tokenizer

TINY_BYTES = 120_000  # a few standard-library files: prepared in well under a second
VOCAB = 512


def _mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in Path(folder).iterdir()}


def _must_not_run(*args, **kwargs):
    raise AssertionError("a reuse of the cache prepared (read, trained or tokenized) the corpus again")


def test_prepares_once_then_reuses(tmp_path, monkeypatch):
    prefix, model, prepared = ensure_builtin_corpus(VOCAB, tmp_path, max_bytes=TINY_BYTES)
    assert prepared
    folder = Path(prefix).parent
    assert folder.parent == tmp_path and folder.name.startswith("builtin-")
    before = _mtimes(folder)

    # a reuse does none of the preparation's work: no documents read, no tokenizer trained
    for name in ("_build", "builtin_documents", "train_tokenizer"):
        monkeypatch.setattr(builtin, name, _must_not_run)
    again = ensure_builtin_corpus(VOCAB, tmp_path, max_bytes=TINY_BYTES)
    monkeypatch.undo()
    assert again == (prefix, model, False)
    assert _mtimes(folder) == before, "a reuse must not rewrite the cache"
    assert prepare_builtin_corpus(VOCAB, tmp_path, max_bytes=TINY_BYTES) == (prefix, model)

    # the stored documents are exactly the selected sources, each closed by the eod token
    tok = load_tokenizer(model)
    assert tok.vocab_size == VOCAB
    ds = IndexedDataset(prefix)
    docs = list(builtin_documents(TINY_BYTES))
    assert len(ds) == len(docs) > 10
    for i in range(len(ds)):
        ids = ds[i]
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == docs[i]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"] == len(docs) and meta["vocab_size"] == VOCAB


def test_selection_is_bounded_and_exact():
    files = stdlib_sources(TINY_BYTES)
    assert sum(f.stat().st_size for f in files) <= TINY_BYTES
    assert files == stdlib_sources(TINY_BYTES), "the selection must be deterministic"
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.parts)
    for f in files:
        text = f.read_text(encoding="utf-8")
        pieces = split_source(text)
        assert "".join(pieces) == text and all(pieces)
    assert corpus_key(VOCAB, TINY_BYTES) != corpus_key(VOCAB + 1, TINY_BYTES)
    assert corpus_key(VOCAB, TINY_BYTES) != corpus_key(VOCAB, 2 * TINY_BYTES)


@pytest.mark.slow
def test_default_corpus_preparation_is_bounded(tmp_path, monkeypatch):
    """Preparing stays a small part of the default run because its work is bounded: at most
    DEFAULT_MAX_BYTES of source read, one tokenizer trained on it (on every thread, up to 8), and
    the documents tokenized in one batched call."""
    calls = {"train_tokenizer": [], "tokenize_batch": []}
    train_tokenizer, tokenize_batch = builtin.train_tokenizer, SentencePieceTokenizer.tokenize_batch

    def counted_training(docs, *args, **kwargs):
        calls["train_tokenizer"].append((len(docs), kwargs.get("num_threads")))
        return train_tokenizer(docs, *args, **kwargs)

    def counted_tokenizing(self, docs, *args, **kwargs):
        calls["tokenize_batch"].append(len(docs))
        return tokenize_batch(self, docs, *args, **kwargs)

    monkeypatch.setattr(builtin, "train_tokenizer", counted_training)
    monkeypatch.setattr(SentencePieceTokenizer, "tokenize_batch", counted_tokenizing)
    prefix, model = prepare_builtin_corpus(4096, tmp_path)
    sources = stdlib_sources()
    assert sum(f.stat().st_size for f in sources) <= builtin.DEFAULT_MAX_BYTES
    ds = IndexedDataset(prefix)
    threads = min(os.cpu_count() or 1, 8)
    assert calls == {"train_tokenizer": [(len(ds), threads)], "tokenize_batch": [len(ds)]}, calls
    assert len(ds) > 1000 and 1_000_000 < ds.sequence_lengths.sum() < 4_000_000


def _prepare_when_released(cache, start, results):
    start.wait()  # both processes are up: release them at once
    results.put(ensure_builtin_corpus(VOCAB, cache, max_bytes=TINY_BYTES))


def test_two_processes_starting_together(tmp_path):
    # forked processes start at once with everything imported, so they really race
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(2), ctx.Queue()
    cache = tmp_path / "cache"
    children = [ctx.Process(target=_prepare_when_released, args=(cache, start, results))
                for _ in range(2)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    (prefix_a, model_a, prepared_a), (prefix_b, model_b, prepared_b) = outcomes
    assert (prefix_a, model_a) == (prefix_b, model_b)
    assert sorted([prepared_a, prepared_b]) == [False, True], "exactly one process prepares"
    leftovers = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [Path(prefix_a).parent.name], "no temporary folders may remain"
    docs = list(builtin_documents(TINY_BYTES))
    ds, tok = IndexedDataset(prefix_a), load_tokenizer(model_a)
    assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == docs
