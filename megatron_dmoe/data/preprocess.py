"""Tokenise documents into megatron-core indexed datasets (.bin/.idx), as Megatron-LM's tool does.

Each JSON key becomes one dataset `{output_prefix}_{key}_document.bin/.idx` (Megatron-LM's names),
each document its token ids followed by the end-of-document token. Empty documents are skipped
and counted: a split without tokens makes megatron-core's GPTDataset loop forever. Files are
written under temporary names and renamed at the end, so an interrupted run leaves no dataset
that looks complete.
"""
from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from itertools import islice
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tqdm import tqdm

from megatron_dmoe.data.documents import Document, iter_documents, list_input_files
from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.megatron_tokenizers import TokenizerSpec

# Documents per task sent to a worker: large enough to amortise inter-process traffic.
_BATCH_DOCUMENTS = 128


@dataclass
class DatasetStats:
    """What one written dataset holds."""

    key: str
    prefix: str  # the data path prefix: `prefix + ".bin"` and `prefix + ".idx"`
    documents: int  # documents written
    skipped: int  # empty documents left out
    tokens: int  # tokens written, end-of-document tokens included


def dataset_prefix(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming of the dataset made from JSON key `key`."""
    return f"{output_prefix}_{key}_document"


class IndexedDatasetWriter:
    """Writes documents of token ids to `prefix.bin/.idx` through megatron-core's builder."""

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = prefix
        self.dtype = DType.optimal_dtype(vocab_size)
        self.vocab_size = vocab_size
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        self._builder = IndexedDatasetBuilder(self._tmp + ".bin", dtype=self.dtype)
        self.documents = self.skipped = self.tokens = 0

    def add(self, ids: Optional[np.ndarray]) -> None:
        """Append one document; None or no tokens counts as skipped."""
        if ids is None or len(ids) == 0:
            self.skipped += 1
            return
        ids = np.asarray(ids)
        self._builder.add_document(ids.astype(self.dtype, copy=False), [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def commit(self) -> None:
        """Write the index and move both files to their final names."""
        self._builder.finalize(self._tmp + ".idx")
        if self.documents == 0:
            self.abort()
            raise DataError(
                f"no documents for {self.prefix}: all {self.skipped} were empty, and a dataset "
                "without tokens cannot be trained on; check the inputs and --json-keys"
            )
        os.replace(self._tmp + ".bin", self.prefix + ".bin")
        os.replace(self._tmp + ".idx", self.prefix + ".idx")

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._builder.data_file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self._tmp + suffix):
                os.remove(self._tmp + suffix)

    def stats(self, key: str) -> DatasetStats:
        return DatasetStats(key, self.prefix, self.documents, self.skipped, self.tokens)


# -- encoding, in this process or in worker processes ---------------------------------------------
_worker_tokenizer = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    _worker_tokenizer = spec.build()


def _encode_batch(batch: List[Document]) -> List[Dict[str, Optional[np.ndarray]]]:
    return encode_documents(_worker_tokenizer, batch)


def encode_documents(
    tokenizer, batch: List[Document]
) -> List[Dict[str, Optional[np.ndarray]]]:
    """Token ids (end-of-document appended) per document and key; None where the text is empty."""
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out = []
    for doc in batch:
        encoded = {}
        for key, text in doc.items():
            if not text:
                encoded[key] = None
            else:
                encoded[key] = np.array(tokenizer.tokenize(text) + [tokenizer.eod], dtype=dtype)
        out.append(encoded)
    return out


def _batches(documents: Iterable[Document], size: int) -> Iterator[List[Document]]:
    it = iter(documents)
    while batch := list(islice(it, size)):
        yield batch


def _encoded_stream(
    documents: Iterable[Document], tokenizer, spec: TokenizerSpec, workers: int
) -> Iterator[List[Dict[str, Optional[np.ndarray]]]]:
    batches = _batches(documents, _BATCH_DOCUMENTS)
    if workers <= 1:
        for batch in batches:
            yield encode_documents(tokenizer, batch)
        return
    # fork where the platform has it: workers then start without re-importing torch
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        # imap keeps the input order, so any number of workers writes the same files
        yield from pool.imap(_encode_batch, batches)


def preprocess_data(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_model: Optional[str] = None,
    *,
    tokenizer_type: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    vocab_size: Optional[int] = None,
    json_keys: Sequence[str] = ("text",),
    input_format: str = "auto",
    split_lines: bool = False,
    glob: Optional[str] = None,
    workers: int = 1,
    progress: bool = True,
) -> Dict[str, DatasetStats]:
    """Tokenise `inputs` (files or folders) into one indexed dataset per JSON key.

    The tokenizer is named as in Megatron-LM (see data/megatron_tokenizers.py): `tokenizer_type` with its
    files, or just a sentencepiece `tokenizer_model`. Returns {key: DatasetStats}. See
    `iter_documents` for what a document is.
    """
    json_keys = list(json_keys)
    if len(set(json_keys)) != len(json_keys):
        raise DataError(f"--json-keys repeats a key: {json_keys}")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if tokenizer_type is None and tokenizer_model is None:
        raise DataError("no tokenizer: give --tokenizer-model (a sentencepiece .model), or --tokenizer-type "
                        "with its files as in Megatron-LM (e.g. GPT2BPETokenizer --vocab-file --merge-file)")
    spec = TokenizerSpec(tokenizer_type or "SentencePieceTokenizer", tokenizer_model, vocab_file, merge_file,
                         vocab_size)
    tokenizer = spec.build()
    files = list_input_files(inputs, glob)
    documents = iter_documents(files, json_keys, input_format, split_lines)
    writers = {k: IndexedDatasetWriter(dataset_prefix(output_prefix, k), tokenizer.vocab_size)
               for k in json_keys}
    bar = tqdm(unit="doc", desc="tokenising", disable=None if progress else True)
    try:
        for encoded_batch in _encoded_stream(documents, tokenizer, spec, workers):
            for encoded in encoded_batch:
                for key, ids in encoded.items():
                    writers[key].add(ids)
            bar.update(len(encoded_batch))
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        bar.close()
    for i, writer in enumerate(writers.values()):
        try:
            writer.commit()
        except BaseException:
            for other in list(writers.values())[i + 1:]:
                other.abort()
            raise
    return {key: writer.stats(key) for key, writer in writers.items()}
