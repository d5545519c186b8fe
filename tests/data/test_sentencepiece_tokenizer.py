"""The sentencepiece tokenizer: exact round trips, special tokens, megatron-core's interface,
deterministic training, and clear errors for bad model files."""
import json
import pickle

import pytest
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer, train_tokenizer


def test_round_trip_of_random_text(tiny_tokenizer, rng, random_text):
    specials = {tiny_tokenizer.eod, tiny_tokenizer.bos, tiny_tokenizer.pad}
    for _ in range(60):
        text = random_text(rng)
        ids = tiny_tokenizer.tokenize(text)
        assert tiny_tokenizer.detokenize(ids) == text, f"seed {rng.seed_}: {text!r}"
        assert all(0 <= i < tiny_tokenizer.vocab_size for i in ids)
        assert not specials & set(ids), "text must never encode to a special token"


def test_batch_tokenize_equals_single(tiny_tokenizer, rng, random_text):
    texts = [random_text(rng) for _ in range(20)] + ["a\u2581b", ""]
    assert tiny_tokenizer.tokenize_batch(texts, num_threads=2) == \
        [tiny_tokenizer.tokenize(t) for t in texts]


def test_space_mark_survives(tiny_tokenizer):
    # sentencepiece alone decodes U+2581 as a space; the tokenizer spells it in bytes
    for text in ["\u2581", "x\u2581y", " \u2581 \u2581\u2581", "\u2581\n"]:
        assert tiny_tokenizer.detokenize(tiny_tokenizer.tokenize(text)) == text


def test_special_tokens_and_vocab(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.vocab_size == 400 == len(tok.vocab)
    assert tok.eod == tok.eos == tok.vocab["</s>"]
    assert tok.bos == tok.vocab["<s>"] and tok.pad == tok.vocab["<pad>"]
    assert len({tok.eod, tok.bos, tok.pad, tok.unk}) == 4
    assert all(tok.inv_vocab[i] == p for p, i in tok.vocab.items())
    assert tok.detokenize([tok.eod]) == ""
    for name in ("cls", "sep", "mask"):
        with pytest.raises(NotImplementedError):
            getattr(tok, name)


def test_megatron_interface_and_pickling(tiny_tokenizer):
    assert isinstance(tiny_tokenizer, MegatronTokenizerBase)
    # megatron-core hashes the tokenizer into its cache names exactly like this
    described = json.dumps({"t": tiny_tokenizer}, default=lambda o: o.unique_identifiers)
    assert tiny_tokenizer.md5 in described
    clone = pickle.loads(pickle.dumps(tiny_tokenizer))
    text = "def f(x):\n    return x  # é\u2581"
    assert clone.tokenize(text) == tiny_tokenizer.tokenize(text)
    assert clone.unique_identifiers == tiny_tokenizer.unique_identifiers


def test_training_is_deterministic(tmp_path, train_text):
    a = load_tokenizer(train_tokenizer(train_text, 400, tmp_path / "a", seed=3))
    b = load_tokenizer(train_tokenizer(train_text, 400, tmp_path / "b", seed=3))
    # the model files differ only in the output name they record; pieces and scores must match
    assert a.vocab == b.vocab
    assert [a._sp.get_score(i) for i in range(400)] == [b._sp.get_score(i) for i in range(400)]


def test_training_from_files_and_folders(tmp_path, rng, random_text):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    # words that become single pieces only if their file (and JSON field) is read
    records = [{"body": "zyzzyva quokka " * 5, "other": "wombat " * 20}] * 20
    (folder / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (folder / "sub" / "b.txt").write_text("axolotl narwhal\n" * 100)
    model = train_tokenizer([folder, "pangolin " * 50], 340, tmp_path / "files",
                            json_keys=["body"])
    tok = load_tokenizer(model)
    assert tok.vocab_size == 340
    for word in ("zyzzyva", "quokka", "axolotl", "narwhal", "pangolin"):
        assert len(tok.tokenize(word)) <= 2, word
    # "m" and "b" occur only in the field left out, so they have no piece of their own
    assert all(tok._sp.is_byte(i) for i in tok.tokenize("mb"))
    text = random_text(rng)
    assert tok.detokenize(tok.tokenize(text)) == text, f"seed {rng.seed_}"


def test_vocabulary_too_large_for_the_text(tmp_path, train_text):
    with pytest.raises(DataError, match=r"vocab_size=100000.*too high"):
        train_tokenizer(train_text, 100000, tmp_path / "big")


def test_training_without_text(tmp_path):
    with pytest.raises(DataError, match="no text"):
        train_tokenizer(["", ""], 400, tmp_path / "empty")


def test_missing_model_file(tmp_path):
    path = tmp_path / "nope.model"
    with pytest.raises(DataError) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value) and "tools/train_tokenizer.py" in str(err.value)


def test_unreadable_model_file(tmp_path, rng):
    path = tmp_path / "garbage.model"
    path.write_bytes(bytes(rng.randrange(256) for _ in range(500)))
    with pytest.raises(DataError, match=f"cannot read the sentencepiece model {path}"):
        load_tokenizer(path)
