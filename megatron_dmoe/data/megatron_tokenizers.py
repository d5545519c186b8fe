"""Megatron-LM's tokenizer types (`--tokenizer-type` and its files), built through megatron-core.

`data.tokenizer_type` takes Megatron-LM's names; the files are named as there too
(`data.vocab_file` / `--vocab-file`, `data.merge_file` / `--merge-file`, `data.tokenizer_model` /
`--tokenizer-model`, `data.vocab_size` / `--vocab-size` for NullTokenizer):

- GPT2BPETokenizer: a GPT-2 byte-level BPE vocabulary (vocab.json + merges.txt), through
  megatron-core's HuggingFace tokenizer (needs `transformers`). megatron-core's own GPT2BPETokenizer
  path asks the hub for "gpt2" (and passes the vocabulary as the merges), so the two files are
  staged as a local tokenizer folder in the cache instead: nothing is downloaded.
- HuggingFaceTokenizer: a local tokenizer folder (or a hub name where the hub is reachable).
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: a sentencepiece .model, read by
  this package's SentencePieceTokenizer (megatron-core's tokenizer interface; unlike megatron-core's
  wrapper it keeps repeated whitespace, so text round-trips).
- TikTokenizer: a tiktoken vocabulary file (needs `tiktoken`).
- NullTokenizer: no files; documents are space-separated token ids, the end-of-document id is
  `vocab_size`.
"""
from __future__ import annotations

import hashlib
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_dmoe.config.tokenizer_types import (  # noqa: F401 (validation reads them there)
    EXTRA_MODULES,
    FLAGS,
    REQUIRED_KEYS,
    SENTENCEPIECE_TYPES,
    TOKENIZER_TYPES,
    missing_module,
)
from megatron_dmoe.data.errors import DataError

# huggingface's own "no limit" (transformers' VERY_LARGE_INTEGER): documents are longer than GPT-2's 1024
_NO_LENGTH_LIMIT = int(1e30)


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer to build; picklable, so preprocessing workers build their own."""

    tokenizer_type: str
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    cache_dir: Optional[str] = None  # where GPT2BPETokenizer's files are staged

    def describe(self) -> str:
        files = [f"{key}={getattr(self, key)}" for key in REQUIRED_KEYS.get(self.tokenizer_type, ())]
        return f"data.tokenizer_type={self.tokenizer_type}" + (f" ({', '.join(files)})" if files else "")

    def build(self):
        """The tokenizer (megatron-core's interface: tokenize, detokenize, vocab_size, eod, ...);
        DataError names the setting or file at fault."""
        kind = self.tokenizer_type
        if kind not in TOKENIZER_TYPES:
            raise DataError(f"data.tokenizer_type={kind!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}")
        missing = [f"data.{key} ({FLAGS[key]})" for key in REQUIRED_KEYS[kind] if getattr(self, key) in (None, "")]
        if missing:
            raise DataError(f"data.tokenizer_type={kind} needs {' and '.join(missing)}")
        module = missing_module(kind)
        if module:
            raise DataError(f"data.tokenizer_type={kind} needs the Python package {module}")
        for key in ("tokenizer_model", "vocab_file", "merge_file"):
            path = getattr(self, key)
            if path and key in REQUIRED_KEYS[kind] and kind not in SENTENCEPIECE_TYPES \
                    and not _local_or_hub_name(kind, key, path):
                raise DataError(f"data.{key}={path}: no such file or folder ({self.describe()})")
        if kind in SENTENCEPIECE_TYPES:
            from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

            try:
                return load_tokenizer(self.tokenizer_model)
            except DataError as err:
                raise DataError(f"data.tokenizer_model: {err}") from None
        args = _megatron_args(self)
        if kind == "GPT2BPETokenizer":
            args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", str(self._staged_gpt2_folder())
            args.vocab_file = args.merge_file = None
        from megatron_dmoe.compat.mcore import build_megatron_tokenizer

        try:
            return build_megatron_tokenizer(args)
        except (ValueError, OSError, AssertionError, KeyError) as err:
            raise DataError(f"cannot build the tokenizer {self.describe()}: {err}") from None

    def _staged_gpt2_folder(self) -> Path:
        """vocab.json + merges.txt as a local GPT-2 tokenizer folder, named by their contents."""
        contents = [_read(self.vocab_file, "vocab_file"), _read(self.merge_file, "merge_file")]
        try:
            json.loads(contents[0])
        except ValueError as err:
            raise DataError(f"data.vocab_file={self.vocab_file} is not a GPT-2 vocab.json (JSON): {err}") from None
        digest = hashlib.md5(b"\0".join(contents), usedforsecurity=False).hexdigest()
        if self.cache_dir:
            base = Path(os.path.expanduser(self.cache_dir))
        else:
            from megatron_dmoe.data.cache import default_cache_dir

            base = default_cache_dir()
        folder = base / "tokenizers" / f"gpt2bpe-{digest}"
        config = json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": _NO_LENGTH_LIMIT}).encode()
        for name, data in (("vocab.json", contents[0]), ("merges.txt", contents[1]), ("tokenizer_config.json", config)):
            _write_once(folder / name, data)
        return folder


def spec_from_data_config(data) -> Optional[TokenizerSpec]:
    """The run's tokenizer from its data section; None means the built-in corpus's own."""
    if data.tokenizer_type:
        return TokenizerSpec(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                             data.vocab_size, data.cache_dir)
    if data.tokenizer_model:  # a sentencepiece model, as before tokenizer types existed
        return TokenizerSpec("SentencePieceTokenizer", data.tokenizer_model, cache_dir=data.cache_dir)
    return None


def _megatron_args(spec: TokenizerSpec) -> types.SimpleNamespace:
    """The Megatron-LM arguments megatron-core's build_tokenizer reads, at Megatron-LM's defaults."""
    return types.SimpleNamespace(
        tokenizer_type=spec.tokenizer_type, tokenizer_model=spec.tokenizer_model, vocab_file=spec.vocab_file,
        merge_file=spec.merge_file, vocab_size=spec.vocab_size, tokenizer_metadata=None,
        tokenizer_special_tokens=None, tokenizer_hf_use_fast=False, trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False, tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
    )


def _local_or_hub_name(kind: str, key: str, path: str) -> bool:
    if os.path.exists(os.path.expanduser(path)):
        return True
    # a HuggingFace hub name ("org/model") is not a local path; megatron-core asks the hub
    return kind == "HuggingFaceTokenizer" and key == "tokenizer_model" and not path.startswith((".", "/", "~"))


def _read(path: str, key: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as err:
        raise DataError(f"cannot read data.{key}={path}: {err.strerror or err}") from None


def _write_once(path: Path, data: bytes) -> None:
    """Write under a temporary name and rename: ranks and workers may stage the same folder."""
    if path.exists() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
