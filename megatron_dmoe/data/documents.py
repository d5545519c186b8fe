"""Reading documents out of input files: JSONL records, whole text files, or text lines.

A document is a dict {key: text or None} (one entry per requested JSON key); None or "" marks an
empty field, which the writer skips and counts. Files are read in a fixed order (inputs as given,
folders walked in sorted order) so that every run sees the documents in the same order.
"""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

from megatron_dmoe.data.errors import DataError

PathLike = Union[str, "os.PathLike[str]"]
Document = Dict[str, Optional[str]]

JSONL_SUFFIXES = (".jsonl", ".json")
INPUT_FORMATS = ("auto", "jsonl", "text")


def list_input_files(inputs: Sequence[PathLike], glob: Optional[str] = None) -> List[Path]:
    """Input files in reading order: each file as given; folders walked recursively, sorted,
    hidden names skipped, file names filtered by `glob` (e.g. "*.jsonl") when given."""
    files: List[Path] = []
    missing = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = _walk_sorted(path, glob)
            if not found:
                raise DataError(
                    f"the input folder {path} holds no files"
                    + (f" matching --glob {glob!r}" if glob else "")
                )
            files.extend(found)
        else:
            missing.append(str(path))
    if missing:
        raise DataError("input not found: " + ", ".join(missing))
    if not files:
        raise DataError("no input files given")
    return files


def _walk_sorted(folder: Path, glob: Optional[str]) -> List[Path]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or (glob and not fnmatch.fnmatch(name, glob)):
                continue
            out.append(Path(root) / name)
    return out


def file_format(path: Path, input_format: str = "auto") -> str:
    """'jsonl' or 'text': as forced by `input_format`, else by the file's suffix."""
    if input_format not in INPUT_FORMATS:
        raise DataError(f"input format {input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
    if input_format != "auto":
        return input_format
    return "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"


def iter_documents(
    files: Sequence[PathLike],
    json_keys: Sequence[str] = ("text",),
    input_format: str = "auto",
    split_lines: bool = False,
) -> Iterator[Document]:
    """Documents of all `files` in order. JSONL: one document per record, one field per key.
    Text: the whole file is one document (exactly as stored, line endings included), or each
    line is one (without its line ending) with `split_lines`; text goes under the first key."""
    json_keys = list(json_keys)
    if not json_keys:
        raise DataError("--json-keys needs at least one key")
    for item in files:
        path = Path(item)
        if file_format(path, input_format) == "jsonl":
            yield from _jsonl_documents(path, json_keys)
        else:
            if len(json_keys) > 1:
                raise DataError(
                    f"{path} is a text file, but several --json-keys ({', '.join(json_keys)}) "
                    "only make sense for JSONL input; give one key"
                )
            yield from ({json_keys[0]: text} for text in _text_documents(path, split_lines))


def _open_text(path: Path):
    # newline="" keeps line endings as stored, so whole-file documents round-trip byte-exactly
    return open(path, "r", encoding="utf-8", errors="strict", newline="")


def _decode_error(path: Path, err: UnicodeDecodeError) -> DataError:
    return DataError(
        f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); convert it to UTF-8 or "
        "leave it out (--glob selects files in folders)"
    )


def _text_documents(path: Path, split_lines: bool) -> Iterator[str]:
    try:
        with _open_text(path) as f:
            if not split_lines:
                yield f.read()
                return
            for line in f:
                yield _strip_line_ending(line)
    except UnicodeDecodeError as err:
        raise _decode_error(path, err) from None


def _strip_line_ending(line: str) -> str:
    if line.endswith("\r\n"):
        return line[:-2]
    return line[:-1] if line.endswith(("\n", "\r")) else line


def _jsonl_documents(path: Path, json_keys: List[str]) -> Iterator[Document]:
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                yield _json_record(path, lineno, line, json_keys)
    except UnicodeDecodeError as err:
        raise _decode_error(path, err) from None


def _json_record(path: Path, lineno: int, line: str, json_keys: List[str]) -> Document:
    where = f"{path} line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg}); JSONL needs one object per line")
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    doc: Document = {}
    for key in json_keys:
        if key not in record:
            raise DataError(
                f"{where}: no key {key!r} (keys there: {', '.join(map(repr, record)) or 'none'}); "
                "name the text field with --json-keys"
            )
        value = record[key]
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {key!r} holds {type(value).__name__}, not text")
        doc[key] = value
    return doc
