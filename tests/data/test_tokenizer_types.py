"""Megatron-LM's tokenizer types (data.tokenizer_type, tools/preprocess_data.py --tokenizer-type),
built through megatron-core with tiny tokenizer files made here (nothing is downloaded), and data
written with a GPT-2 BPE vocabulary training as it is."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dmoe.config import Environment, find_problems, find_warnings
from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.data import megatron_tokenizers
from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.megatron_tokenizers import TokenizerSpec
from train_helpers import SMALL, losses, run_train

ROOT = Path(__file__).resolve().parents[2]
CPU = Environment(cuda=False, transformer_engine=False, apex=False)
EOD = "<|endoftext|>"


def _byte_symbols():
    """GPT-2's printable stand-ins for the 256 bytes (its bytes_to_unicode table)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


@pytest.fixture
def gpt2_files(tmp_path, monkeypatch):
    """A tiny GPT-2 BPE vocabulary: the 256 byte symbols, a few merges, and <|endoftext|>."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the files are staged
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab[EOD] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                         encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe_from_vocab_and_merges(gpt2_files):
    vocab_file, merge_file, vocab = gpt2_files
    tok = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file).build()
    assert tok.vocab_size == len(vocab) and tok.eod == vocab[EOD]
    text = "the cat in the hat, 3 × 4\n"
    ids = tok.tokenize(text)
    assert vocab["Ġthe"] in ids and vocab["in"] in ids  # the merges apply
    assert tok.detokenize(ids) == text  # byte-level: any text round-trips


def test_null_tokenizer_reads_ids():
    tok = TokenizerSpec("NullTokenizer", vocab_size=100).build()
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("3 14 15") == [3, 14, 15]


def test_sentencepiece_types_read_the_model(tiny_model):
    for kind in megatron_tokenizers.SENTENCEPIECE_TYPES:
        tok = TokenizerSpec(kind, tokenizer_model=str(tiny_model)).build()
        assert tok.vocab_size == 400 and tok.detokenize(tok.tokenize("def f(x):  return x")) == "def f(x):  return x"


def test_huggingface_tokenizer_from_a_local_folder(gpt2_files, tmp_path):
    vocab_file, merge_file, vocab = gpt2_files
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, src in (("vocab.json", vocab_file), ("merges.txt", merge_file)):
        (folder / name).write_bytes(Path(src).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    tok = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(folder)).build()
    assert tok.vocab_size == len(vocab) and tok.detokenize(tok.tokenize("in the")) == "in the"


def test_missing_settings_and_packages_are_named(monkeypatch, tmp_path):
    with pytest.raises(DataError, match=r"GPT2BPETokenizer needs data.merge_file \(--merge-file\)"):
        TokenizerSpec("GPT2BPETokenizer", vocab_file="v.json").build()
    with pytest.raises(DataError, match=r"NullTokenizer needs data.vocab_size \(--vocab-size\)"):
        TokenizerSpec("NullTokenizer").build()
    with pytest.raises(DataError, match="data.vocab_file=.*missing.json: no such file"):
        TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"), merge_file="m").build()
    monkeypatch.setitem(megatron_tokenizers.EXTRA_MODULES, "GPT2BPETokenizer",
                        ("no_such_module_here", "pip install it"))
    with pytest.raises(DataError, match="needs the Python package no_such_module_here"):
        TokenizerSpec("GPT2BPETokenizer", vocab_file="v", merge_file="m").build()


def test_validation_names_the_key_before_any_work():
    cfg = RunConfig()
    cfg.data.data_path = ["data/x_text_document"]
    cfg.data.tokenizer_type = "GPT2BPETokenizer"
    cfg.data.vocab_file = "vocab.json"
    problems = find_problems(cfg, env=CPU)
    assert [k for k, _ in problems] == ["data.tokenizer_type"]
    assert "needs data.merge_file (--merge-file)" in problems[0][1]
    cfg.data.tokenizer_type = "GPT2BPE"
    assert "did you mean GPT2BPETokenizer" in find_problems(cfg, env=CPU)[0][1]
    cfg.data.tokenizer_type, cfg.data.vocab_file = "NullTokenizer", None
    cfg.data.vocab_size = 128
    assert find_problems(cfg, env=CPU) == []
    cfg.data.tokenizer_model = "tok.model"
    assert [k for k, _ in find_warnings(cfg, env=CPU)] == ["data.tokenizer_model"]  # unused by NullTokenizer
    cfg.data.data_path = []
    assert "data.data_path is empty" in find_problems(cfg, env=CPU)[0][1]


def test_gpt2_bpe_data_trains_as_it_is(gpt2_files, tmp_path):
    """Preprocess with Megatron-LM's flags, then a few steps of dmoe-train naming the same files."""
    vocab_file, merge_file, vocab = gpt2_files
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"the hat {i} in the cat; " * (1 + i % 7)}) + "\n")
    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                           str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "gpt2"),
                           "--no-progress", *tokenizer_flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    done = run_train(run, *SMALL, "model.num_layers=1", "model.seq_length=32", "training.train_iters=3",
                     "training.eval_interval=0", "checkpoint.save_interval=0", "data.num_workers=0",
                     f"data.data_path=[{tmp_path / 'gpt2_text_document'}]", "data.tokenizer_type=GPT2BPETokenizer",
                     f"data.vocab_file={vocab_file}", f"data.merge_file={merge_file}")
    assert done.returncode == 0, done.stderr[-3000:]
    # 60 documents: the default split leaves the test split empty, which training does not read
    assert "warning: data.split='969,30,1' leaves the test split without documents" in done.stderr
    assert len(losses(run)) == 3
    saved = (run / "config.yaml").read_text()
    assert "tokenizer_type: GPT2BPETokenizer" in saved and "vocab_file:" in saved
