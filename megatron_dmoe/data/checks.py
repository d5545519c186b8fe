"""Checks of data files and tokenizers before megatron-core sees them.

megatron-core answers a missing file with a bare assertion, reads a truncated .bin only when a
sample falls past its end, and loops forever on a split without tokens. These checks turn each of
those into one `DataError` that names the file or key and says what to do. The .idx layout read
here is megatron-core's (MMIDIDX version 1): a 34-byte header, then int32 sequence lengths, int64
byte offsets, int64 document boundaries and, for multimodal data only, int8 modes.
"""
from __future__ import annotations

import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import DType

from megatron_dmoe.data.errors import DataError, DataWarning

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34
SPLIT_NAMES = ("train", "valid", "test")
_MAKE_DATA = "make .bin/.idx pairs with tools/preprocess_data.py"


@dataclass
class IndexInfo:
    """What an indexed dataset's .idx says, after checking it against its .bin."""

    prefix: str
    dtype: type  # numpy dtype of token ids in the .bin
    sequence_lengths: np.ndarray  # tokens per sequence (= per document for GPT data)
    num_documents: int
    num_tokens: int


def check_data_files(prefixes: Sequence[str]) -> List[IndexInfo]:
    """Check that every prefix has a readable, consistent .bin/.idx pair; one DataError names
    every missing file, or the first corrupt one."""
    missing, hints = [], []
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if prefix.endswith(suffix):
                hints.append(f"{prefix!r} ends in {suffix}: data.data_path takes the prefix "
                             f"without .bin/.idx ({prefix[:-len(suffix)]!r})")
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                missing.append(prefix + suffix)
    if missing:
        lines = "\n".join("  " + m for m in missing)
        hint = ("\n" + "\n".join(hints)) if hints else ""
        raise DataError(
            f"data files not found (data.data_path):\n{lines}{hint}\n"
            f"Each entry of data.data_path is a prefix PREFIX of PREFIX.bin and PREFIX.idx; "
            f"{_MAKE_DATA}: python tools/preprocess_data.py --input DOCS.jsonl "
            f"--output-prefix OUT --tokenizer-model TOKENIZER.model writes "
            f"OUT_text_document.bin/.idx."
        )
    return [read_index(prefix) for prefix in prefixes]


def read_index(prefix: str) -> IndexInfo:
    """Read and check `prefix.idx` against `prefix.bin`; DataError naming the bad file."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    redo = "re-create it with tools/preprocess_data.py"

    def corrupt(path: str, why: str) -> DataError:
        return DataError(f"corrupt data file {path}: {why}; {redo}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _HEADER:
        raise corrupt(idx_path, "it does not start like a megatron-core index (.idx) file")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise corrupt(idx_path, f"index format version {version}, expected 1")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise corrupt(idx_path, f"unknown token type code {code}") from None
    expected = _HEADER_BYTES + 12 * seqs + 8 * docs
    if idx_size not in (expected, expected + seqs):
        raise corrupt(idx_path, f"it is {idx_size} bytes, but its header announces {seqs} "
                                f"sequences and {docs} document bounds, which take {expected} "
                                f"(truncated or overwritten)")
    if seqs == 0:
        raise DataError(f"{idx_path} holds no documents; {redo} from non-empty inputs")
    lengths = np.memmap(idx_path, np.int32, "r", _HEADER_BYTES, (seqs,))
    last_pointer = int(np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 12 * seqs - 8, (1,))[0])
    bounds = np.memmap(idx_path, np.int64, "r", _HEADER_BYTES + 12 * seqs, (docs,))
    if docs < 2 or bounds[0] != 0 or bounds[-1] != seqs or np.any(np.diff(bounds) < 0):
        raise corrupt(idx_path, "its document bounds are not increasing from 0 to the "
                                "sequence count")
    if np.any(lengths < 0):
        raise corrupt(idx_path, "it has negative sequence lengths")
    itemsize = np.dtype(dtype).itemsize
    tokens = int(lengths.sum(dtype=np.int64))
    if last_pointer != (tokens - int(lengths[-1])) * itemsize:
        raise corrupt(idx_path, "its sequence offsets do not match its sequence lengths")
    bin_size = os.path.getsize(bin_path)
    if bin_size != tokens * itemsize:
        state = "truncated" if bin_size < tokens * itemsize else "longer than its index says"
        raise DataError(
            f"corrupt data file {bin_path}: it is {bin_size} bytes, but {idx_path} indexes "
            f"{tokens} tokens of {itemsize} bytes ({tokens * itemsize} bytes): the .bin is "
            f"{state}, or the two files come from different runs; {redo}"
        )
    return IndexInfo(prefix, dtype, lengths, int(docs) - 1, tokens)


def split_matrix(split: str) -> List[Optional[Tuple[float, float]]]:
    """megatron-core's [begin, end) fractions per split of data.split ('969,30,1')."""
    try:
        weights = [float(w) for w in re.split(r"[,/]", str(split).strip())]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(0 <= w < float("inf") for w in weights) \
            or sum(weights) <= 0:
        raise DataError(
            f"data.split={split!r} is not a list of up to three non-negative weights for "
            "train, valid and test, such as '969,30,1' (at least one weight above 0)"
        )
    # megatron-core parses the same string itself; this only validates before it does
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))


def check_splits(infos: Sequence[IndexInfo], split: str,
                 read: Sequence[bool] = (True, True, True)) -> List[int]:
    """Every split that data.split turns on and training reads (`read`, per train/valid/test)
    must get tokens from every dataset: megatron-core's GPTDataset never finishes building a split
    that has none. A split left without tokens that nothing reads is a DataWarning, and its index
    is returned: the caller turns it off (megatron-core would loop building it)."""
    matrix = split_matrix(split)
    problems, unread_empty = [], set()
    for info in infos:
        n = len(info.sequence_lengths)
        for i, (name, bookends) in enumerate(zip(SPLIT_NAMES, matrix)):
            if bookends is None:
                continue
            begin, end = (int(round(f * n)) for f in bookends)
            if int(info.sequence_lengths[begin:end].sum(dtype=np.int64)) == 0:
                line = f"  {info.prefix}: the {name} split gets {end - begin} of its {n} documents"
                if read[i]:
                    problems.append(line)
                else:
                    unread_empty.add(i)
                    warnings.warn(DataWarning(
                        f"data.split={split!r} leaves the {name} split without documents, which "
                        f"this run does not read; it is left out:\n{line}\nA weight of 0 turns a "
                        f"split off (e.g. '98,2,0')."), stacklevel=2)
    if problems:
        raise DataError(
            f"data.split={split!r} leaves a split without tokens, which megatron-core's "
            "GPTDataset cannot draw samples from:\n" + "\n".join(problems) + "\nUse more "
            "documents, or weights that give each split at least one document; a weight of 0 "
            "turns a split off (e.g. '98,2,0')."
        )
    return sorted(unread_empty)


def check_tokenizer_matches(
    tokenizer,
    vocab_size_of_model: Optional[int],
    data_prefixes: Sequence[str] = (),
    scan_tokens: int = 1 << 24,
) -> None:
    """DataError when the model's vocabulary (model.vocab_size) is smaller than the tokenizer's
    (data.tokenizer_model), or when data holds ids the tokenizer cannot have made (the first
    `scan_tokens` tokens of each prefix are scanned)."""
    vocab = tokenizer.vocab_size
    where = getattr(tokenizer, "path", "the tokenizer")
    if vocab_size_of_model is not None and vocab_size_of_model < vocab:
        raise DataError(
            f"model.vocab_size={vocab_size_of_model} is smaller than the vocabulary of the "
            f"tokenizer (data.tokenizer_model={where}), which has {vocab} tokens: set "
            f"model.vocab_size to at least {vocab}, or leave it unset to use the tokenizer's size"
        )
    for prefix in data_prefixes:
        info = read_index(prefix)
        count = min(info.num_tokens, scan_tokens)
        top = int(np.memmap(prefix + ".bin", info.dtype, "r", 0, (count,)).max())
        if top >= vocab:
            raise DataError(
                f"{prefix}.bin holds token id {top}, but the tokenizer "
                f"(data.tokenizer_model={where}) has only {vocab} tokens: the data was made with "
                f"a different tokenizer; set data.tokenizer_model to the one given to "
                f"tools/preprocess_data.py for this data"
            )
