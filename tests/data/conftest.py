"""Shared fixtures of the data tests: a tiny tokenizer and random text."""
import os
import random

import pytest

from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer, train_tokenizer

# Code-point ranges random text draws from: ASCII, whitespace and controls, Latin-1, combining
# marks, Greek, CJK, emoji, and sentencepiece's own space mark U+2581.
_RANGES = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0xFF), (0x300, 0x36F), (0x391, 0x3C9),
           (0x4E00, 0x4E80), (0x1F600, 0x1F64F), (0x2581, 0x2581)]
_WEIGHTS = [60, 6, 8, 3, 5, 5, 3, 2]

TRAIN_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Les élèves étudient à l'école; 日本語のテキスト; Ελληνικά.\n",
    "for i in range(10):\n\tprint(i * 2)  # doubled\n",
    "The quick brown fox jumps over the lazy dog. 0123456789\n",
] * 20


def _random_text(rng: random.Random, max_len: int = 200) -> str:
    chars = []
    for _ in range(rng.randint(1, max_len)):
        lo, hi = rng.choices(_RANGES, _WEIGHTS)[0]
        chars.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.05:
            chars.append(rng.choice(["\n", "\r\n", "    ", "\t", "\n\n"]))
    return "".join(chars)


@pytest.fixture(scope="session")
def random_text():
    """random_text(rng, max_len=200): a string mixing scripts, whitespace, controls and U+2581."""
    return _random_text


@pytest.fixture(scope="session")
def train_text():
    """A few kinds of text (code, accented and CJK prose) to train tiny tokenizers on."""
    return list(TRAIN_TEXT)


@pytest.fixture
def rng():
    """A freshly seeded generator; the seed is in the test's name on failure via `rng.seed_`."""
    seed = int.from_bytes(os.urandom(4), "little")
    r = random.Random(seed)
    r.seed_ = seed
    return r


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of a 400-piece tokenizer trained on TRAIN_TEXT."""
    return train_tokenizer(TRAIN_TEXT, 400, tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def write_dataset():
    """write_dataset(prefix, docs, vocab_size=400): store lists of token ids as an indexed
    dataset, through the same writer preprocessing uses; returns the prefix."""
    from megatron_dmoe.data.preprocess import IndexedDatasetWriter

    def write(prefix, docs, vocab_size=400):
        writer = IndexedDatasetWriter(str(prefix), vocab_size)
        for doc in docs:
            writer.add(doc)
        writer.commit()
        return str(prefix)

    return write


def numbered_documents(first_id, lengths, eod):
    """Documents of consecutive, globally unique token ids, each closed by `eod`, so that the
    origin of every token in a sample can be traced."""
    docs, next_id = [], first_id
    for n in lengths:
        docs.append(list(range(next_id, next_id + n)) + [eod])
        next_id += n
    return docs


@pytest.fixture(scope="session")
def numbered_docs():
    """numbered_docs(first_id, lengths, eod) -> documents of unique consecutive ids + eod."""
    return numbered_documents
