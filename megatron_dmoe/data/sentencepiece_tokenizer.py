"""A sentencepiece tokenizer on megatron-core's tokenizer interface.

megatron-core's GPTDataset reads `vocab_size`, `eod` and, where defined, `pad` from its tokenizer,
and hashes `unique_identifiers` into its index cache names. The class subclasses megatron-core's
`MegatronTokenizerBase` (the type `GPTDatasetConfig.tokenizer` declares) and also offers the
properties of megatron-core's legacy tokenizer interface (`vocab`, `inv_vocab`, `eod`, `bos`,
`eos`, `pad`, ...), so code written against either works with it.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import sentencepiece as spm
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_dmoe.data.documents import iter_documents, list_input_files
from megatron_dmoe.data.errors import DataError

# Sentencepiece writes spaces as U+2581 inside pieces, so that character in the input text would
# come back as a space. The tokenizer spells it with byte pieces instead (see `tokenize`).
_SPACE_MARK = "\u2581"

_TRAIN_HINT = "train one with tools/train_tokenizer.py"


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A sentencepiece model; the end-of-document token (`eod`) is the model's end-of-sequence."""

    def __init__(self, model_path: str, model_proto: Optional[bytes] = None) -> None:
        super().__init__(os.path.abspath(model_path), {"library": "sentencepiece"})
        if model_proto is None:
            model_proto = _read_model_file(self.path)
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as err:
            raise DataError(
                f"cannot read the sentencepiece model {self.path}: {err}. "
                f"Is it a sentencepiece .model file? If not, {_TRAIN_HINT}."
            ) from None
        if self._sp.eos_id() < 0:
            raise DataError(
                f"the sentencepiece model {self.path} has no end-of-sequence piece, which marks "
                f"document ends in the data; {_TRAIN_HINT} (it defines one)."
            )
        self.md5 = hashlib.md5(model_proto, usedforsecurity=False).hexdigest()
        self._mark_ids = _byte_ids(self._sp, _SPACE_MARK)
        self._vocab = None

    # -- encoding ------------------------------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text`; decoding them gives `text` back when the model has byte fallback."""
        if _SPACE_MARK not in text or self._mark_ids is None:
            return self._sp.encode(text)
        ids: List[int] = []
        for i, part in enumerate(text.split(_SPACE_MARK)):
            if i:
                ids.extend(self._mark_ids)
            ids.extend(self._sp.encode(part))
        return ids

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """`tokenize` over many texts; sentencepiece spreads plain texts over `num_threads`."""
        plain = [i for i, t in enumerate(texts) if _SPACE_MARK not in t]
        out: List[Optional[List[int]]] = [None] * len(texts)
        if plain:
            encoded = self._sp.encode([texts[i] for i in plain], num_threads=num_threads)
            for i, ids in zip(plain, encoded):
                out[i] = ids
        for i, ids in enumerate(out):
            if ids is None:
                out[i] = self.tokenize(texts[i])
        return out  # type: ignore[return-value]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids (any int sequence, numpy array or tensor); control tokens vanish."""
        return self._sp.decode([int(i) for i in ids])

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("SentencePieceTokenizer has no chat template")

    # -- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict:
        """Piece text -> id."""
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id -> piece text."""
        return {i: p for p, i in self.vocab.items()}

    def _special(self, name: str, value: int) -> int:
        if value < 0:
            raise NotImplementedError(f"the sentencepiece model {self.path} has no {name} token")
        return value

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._special("bos", self._sp.bos_id())

    @property
    def pad(self) -> int:
        return self._special("pad", self._sp.pad_id())

    @property
    def unk(self) -> int:
        return self._special("unk", self._sp.unk_id())

    @property
    def cls(self) -> int:
        raise NotImplementedError("a sentencepiece GPT tokenizer has no cls token")

    @property
    def sep(self) -> int:
        raise NotImplementedError("a sentencepiece GPT tokenizer has no sep token")

    @property
    def mask(self) -> int:
        raise NotImplementedError("a sentencepiece GPT tokenizer has no mask token")

    # -- identity, for megatron-core's index cache and for pickling ------------------------------
    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["tokenizer_path"] = self.path
        ids["md5"] = self.md5
        return ids

    @property
    def unique_description(self) -> str:
        return json.dumps(self.unique_identifiers, indent=4)

    def __getstate__(self):
        return {"path": self.path, "proto": self._proto}

    def __setstate__(self, state):
        self.__init__(state["path"], state["proto"])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _read_model_file(path: str) -> bytes:
    if not os.path.isfile(path):
        raise DataError(
            f"tokenizer model not found: {path}; give the path of a sentencepiece .model file, "
            f"or {_TRAIN_HINT}."
        )
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise DataError(f"cannot read the tokenizer model {path}: {err}") from None


def _byte_ids(sp: spm.SentencePieceProcessor, text: str) -> Optional[List[int]]:
    """Ids of the byte pieces spelling `text`, or None if the model has no byte fallback."""
    ids = []
    for b in text.encode("utf-8"):
        i = sp.piece_to_id(f"<0x{b:02X}>")
        if i == sp.unk_id() or not sp.is_byte(i):
            return None
        ids.append(i)
    return ids


def load_tokenizer(path: str) -> SentencePieceTokenizer:
    """Load a sentencepiece .model file; a missing or unreadable file raises `DataError`."""
    return SentencePieceTokenizer(os.fspath(path))



# Ids of the special pieces in every tokenizer this project trains.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def train_tokenizer(
    source: Union[Iterable[Union[str, "os.PathLike[str]"]], "os.PathLike[str]"],
    vocab_size: int,
    out_prefix: Union[str, "os.PathLike[str]"],
    *,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    input_sentence_size: int = 2_000_000,
    character_coverage: float = 0.9999,
    max_sentence_length: int = 16384,
    num_threads: Optional[int] = None,
    seed: int = 0,
    verbose: bool = False,
) -> str:
    """Train a sentencepiece model on texts and return the path of `{out_prefix}.model`.

    `source` holds texts (str items) and/or files or folders (os.PathLike items, e.g. Path: JSONL
    fields named by `json_keys`, other files as text). Sentencepiece learns from lines; the model
    keeps whitespace and text exactly (no normalisation, no dummy prefix) and falls back to bytes
    for unseen characters, so any text round-trips. Pieces: <unk>=0, <s>=1, </s>=2 (end of
    document), <pad>=3. The same inputs, settings and seed give the same model file.
    """
    if model_type not in ("bpe", "unigram"):
        raise DataError(f"model_type {model_type!r} is not one of bpe, unigram")
    out_prefix = os.fspath(out_prefix)
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    lines = _training_lines(_texts_of(source, json_keys))
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_prefix=out_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            # identity normalisation and kept spaces: decode(encode(text)) == text, code included
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=character_coverage,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=max_sentence_length,
            num_threads=num_threads or min(os.cpu_count() or 1, 16),
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as err:
        # drop sentencepiece's "INTERNAL: file.cc(123) [check]" preamble, keep its explanation
        reason = str(err).strip().split("] ", 1)[-1]
        raise DataError(
            f"sentencepiece could not train a tokenizer with vocab_size={vocab_size}: {reason}"
        ) from None
    return out_prefix + ".model"


def _texts_of(source, json_keys: Sequence[str]) -> Iterator[str]:
    if isinstance(source, (str, os.PathLike)):
        source = [source]
    for item in source:
        if isinstance(item, os.PathLike):
            for doc in iter_documents(list_input_files([item]), json_keys):
                yield from (t for t in doc.values() if t)
        elif isinstance(item, str):
            yield item
        else:
            raise DataError(
                f"tokenizer training input must be texts (str) or paths (pathlib.Path), "
                f"got {type(item).__name__}"
            )


def _training_lines(texts: Iterable[str]) -> Iterator[str]:
    count = 0
    for text in texts:
        for line in text.split("\n"):
            if line:
                count += 1
                yield line
    if count == 0:
        raise DataError("no text to train a tokenizer on: the inputs are empty")
