"""The built-in corpus: the Python standard library's own sources, present on every machine.

On first use a sentencepiece tokenizer is trained on a bounded, deterministic selection of the
standard library's *.py files and the text is written as an indexed dataset, both cached in
`{cache_dir}/builtin-{key}` (key: hash of the Python version, the selected files, the vocabulary
size and the corpus format). Several processes may start at once (torchrun ranks): a file lock
lets one prepare while the others wait, and the result appears by an atomic rename of a
temporary folder, so no process ever sees a half-written corpus.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from megatron_dmoe.data.cache import default_cache_dir
from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.preprocess import IndexedDatasetWriter
from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

# Bump when the selection, chunking or tokenizer settings change: old caches then go unused.
CORPUS_FORMAT_VERSION = 1
# About 8 MB of source: ~2.6M tokens at vocabulary 4096, prepared in seconds on 2 cores.
DEFAULT_MAX_BYTES = 8_000_000
DATASET_NAME = "builtin_text_document"
TOKENIZER_NAME = "tokenizer"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_MAX_FILE_BYTES = 256_000  # leave out a few huge generated files (pydoc topics, tables)
_DOC_CHARS = 2048  # documents are split at top-level statements once this long ...
_DOC_MAX_CHARS = 4 * _DOC_CHARS  # ... and at any line beyond this


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> List[Path]:
    """The standard library's *.py files (tests and site-packages left out) in sorted order,
    up to `max_bytes` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if size == 0 or size > _MAX_FILE_BYTES:
            continue
        if total + size > max_bytes and chosen:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise DataError(f"no Python sources found under {root} for the built-in corpus")
    return chosen


def split_source(text: str) -> List[str]:
    """Cut a source file into documents of roughly `_DOC_CHARS` at top-level statements;
    the pieces concatenate back to `text`."""
    docs, current, size = [], [], 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        piece = line if i == len(lines) - 1 else line + "\n"
        top_level = line[:1] not in ("", " ", "\t", ")", "]", "}")
        if current and (size >= _DOC_MAX_CHARS or (size >= _DOC_CHARS and top_level)):
            docs.append("".join(current))
            current, size = [], 0
        current.append(piece)
        size += len(piece)
    if current and "".join(current):
        docs.append("".join(current))
    return docs


def builtin_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """The corpus's documents in dataset order (files that are not UTF-8 are left out)."""
    for path in stdlib_sources(max_bytes):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from split_source(text)


def corpus_key(vocab_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = [(p.relative_to(root).as_posix(), p.stat().st_size)
               for p in stdlib_sources(max_bytes)]
    identity = json.dumps([CORPUS_FORMAT_VERSION, sys.version, vocab_size, max_bytes, listing])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def prepare_builtin_corpus(
    vocab_size: int, cache_dir: Optional[str] = None, max_bytes: Optional[int] = None
) -> Tuple[str, str]:
    """Prepare the built-in corpus once and return (data_prefix, tokenizer_model_path).

    `cache_dir` defaults to ~/.cache/megatron_dmoe; `max_bytes` (of source text) to
    DEFAULT_MAX_BYTES. Safe to call from many processes at once."""
    prefix, model, _ = ensure_builtin_corpus(vocab_size, cache_dir, max_bytes)
    return prefix, model


def ensure_builtin_corpus(
    vocab_size: int, cache_dir: Optional[str] = None, max_bytes: Optional[int] = None
) -> Tuple[str, str, bool]:
    """As `prepare_builtin_corpus`, plus whether this call prepared it (False: reused)."""
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    parent = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key = corpus_key(vocab_size, max_bytes)
    final = parent / f"builtin-{key}"
    result = (str(final / DATASET_NAME), str(final / f"{TOKENIZER_NAME}.model"))
    if _complete(final):
        return (*result, False)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot create the corpus cache folder {parent} (data.cache_dir): {err}")
    with _file_lock(parent / f"builtin-{key}.lock"):
        if _complete(final):  # another process prepared it while this one waited
            return (*result, False)
        if final.exists():
            shutil.rmtree(final)
        for stale in parent.glob(f".builtin-{key}.tmp*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".builtin-{key}.tmp", dir=parent))
        try:
            _build(tmp, vocab_size, max_bytes)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return (*result, True)


def _complete(folder: Path) -> bool:
    names = ("meta.json", f"{TOKENIZER_NAME}.model", DATASET_NAME + ".bin", DATASET_NAME + ".idx")
    return all((folder / n).is_file() for n in names)


@contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): rely on the atomic rename alone
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path, vocab_size: int, max_bytes: int) -> None:
    start = time.time()
    docs = list(builtin_documents(max_bytes))
    threads = min(os.cpu_count() or 1, 8)
    logger.info("preparing the built-in corpus (%d documents, vocabulary %d) in %s",
                len(docs), vocab_size, folder.parent)
    model = train_tokenizer(docs, vocab_size, folder / TOKENIZER_NAME, num_threads=threads,
                            input_sentence_size=0)
    tokenizer = load_tokenizer(model)
    writer = IndexedDatasetWriter(str(folder / DATASET_NAME), tokenizer.vocab_size)
    eod = tokenizer.eod
    try:
        for ids in tokenizer.tokenize_batch(docs, num_threads=threads):
            writer.add(ids + [eod])
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    meta = {
        "format_version": CORPUS_FORMAT_VERSION,
        "python": sys.version,
        "vocab_size": vocab_size,
        "max_bytes": max_bytes,
        "documents": writer.documents,
        "tokens": writer.tokens,
        "seconds": round(time.time() - start, 2),
    }
    # written last: its presence marks a complete folder
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
