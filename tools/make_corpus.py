r"""Make a training corpus from folders of text files: train and validation data split by file.

Gathers the text files under the given folders (extension filter, size cap, binaries and non-UTF-8
files skipped, identical files kept once), writes one JSONL document per file, trains a
sentencepiece tokenizer on a sample of the training files, and tokenises both splits with many
workers into megatron-core indexed datasets. Whole files are held out for validation: a file goes
to validation when a hash of its content (salted with --seed) falls below --valid-fraction, so the
split does not depend on where the files live, on their order, or on the other files.

Writes into OUT:
  corpus_train.jsonl, corpus_valid.jsonl   one {"text", "path", "sha256"} record per file
  tokenizer.model, tokenizer.vocab         the sentencepiece tokenizer (unless --tokenizer-model)
  train_text_document.bin/.idx             training data (data.data_path)
  valid_text_document.bin/.idx             validation data (data.valid_data_path)
  summary.json                             counts, token totals, settings, dmoe-train overrides

Example (a machine's Python installation and C/C++ headers, no network needed):
  python tools/make_corpus.py /usr/lib/python3.12 /usr/local/lib/python3.12 /usr/include \
      --out data/ttq --workers 16
  dmoe-train zoo/dense_small data.data_path=[data/ttq/train_text_document] \
      data.valid_data_path=[data/ttq/valid_text_document] data.tokenizer_model=data/ttq/tokenizer.model
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

DEFAULT_EXTENSIONS = ("py,pyi,pyx,pxd,c,h,cc,cpp,cxx,hpp,hh,hxx,inc,inl,ipp,tcc,"
                      "rst,md,txt")
NO_EXTENSION = "none"  # the --extensions entry for files without one (e.g. C++'s <vector>)
SPLITS = ("train", "valid")
SKIP_REASONS = ("extension", "too_large", "empty", "binary", "undecodable", "unreadable",
                "duplicate", "over_total_cap")
OUTPUT_NAMES = ("corpus_train.jsonl", "corpus_valid.jsonl", "tokenizer.model", "tokenizer.vocab",
                "train_text_document.bin", "train_text_document.idx",
                "valid_text_document.bin", "valid_text_document.idx", "summary.json")
MIB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sources", nargs="+", metavar="FOLDER",
                   help="folders to gather text files from (walked recursively in sorted order, "
                        "hidden names skipped); single files are taken as they are")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--extensions", default=DEFAULT_EXTENSIONS, metavar="LIST",
                   help="comma-separated file extensions to keep, without dots; 'none' keeps "
                        f"files without an extension (default: {DEFAULT_EXTENSIONS})")
    p.add_argument("--max-file-kib", type=float, default=512, metavar="KIB",
                   help="skip files larger than this, e.g. generated tables (default 512 KiB)")
    p.add_argument("--max-total-mib", type=float, default=None, metavar="MIB",
                   help="keep at most this much text: files are taken in a hash order (a "
                        "deterministic shuffle over all folders) until the next would pass it "
                        "(default: no cap)")
    p.add_argument("--valid-fraction", type=float, default=0.02, metavar="F",
                   help="expected share of files held out for validation (default 0.02); each "
                        "split gets at least one file")
    p.add_argument("--seed", type=int, default=0,
                   help="salt of the validation hash and seed of tokenizer training (default 0)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="tokenizer vocabulary, specials and 256 byte pieces included (default 32000)")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece algorithm (default bpe)")
    p.add_argument("--tokenizer-sample-mib", type=float, default=100, metavar="MIB",
                   help="train the tokenizer on about this much training text, files taken in "
                        "hash order (default 100 MiB)")
    p.add_argument("--tokenizer-sentences", type=int, default=2_000_000, metavar="N",
                   help="lines sentencepiece samples from that text, 0 = all (default 2000000)")
    p.add_argument("--tokenizer-model", default=None, metavar="MODEL",
                   help="use this sentencepiece .model instead of training one")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16),
                   help="tokenising processes and tokenizer training threads (default: the CPU "
                        "count, at most 16)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier run in OUT (default: refuse)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


class CorpusError(Exception):
    """A mistake in the arguments or inputs, reported as one line before any work."""


@dataclass
class KeptFile:
    path: Path
    sha256: str
    size: int  # bytes
    split: str = "train"


def parse_extensions(text: str) -> List[str]:
    exts = [e.strip().lower().lstrip(".") for e in text.split(",") if e.strip()]
    if not exts:
        raise CorpusError(f"--extensions {text!r} names no extension; e.g. py,rst or 'none'")
    return exts


def check_args(args) -> None:
    """Every argument problem at once, before anything is read or written."""
    problems = []
    for source in args.sources:
        if not os.path.exists(source):
            problems.append(f"source {source!r} does not exist")
    if not 0 < args.valid_fraction < 1:
        problems.append(f"--valid-fraction {args.valid_fraction} must be between 0 and 1 "
                        "(exclusive), e.g. 0.02")
    for flag, value in (("--max-file-kib", args.max_file_kib),
                        ("--max-total-mib", args.max_total_mib),
                        ("--tokenizer-sample-mib", args.tokenizer_sample_mib)):
        if value is not None and not value > 0:
            problems.append(f"{flag} {value} must be positive")
    if args.workers < 1:
        problems.append(f"--workers {args.workers} must be at least 1")
    if args.tokenizer_sentences < 0:
        problems.append(f"--tokenizer-sentences {args.tokenizer_sentences} must be >= 0")
    if args.tokenizer_model is None and args.vocab_size <= 260:
        problems.append(f"--vocab-size {args.vocab_size} must be above 260 (256 byte pieces and "
                        "4 special pieces come first)")
    if args.tokenizer_model is not None and not os.path.isfile(args.tokenizer_model):
        problems.append(f"--tokenizer-model {args.tokenizer_model}: no such file")
    try:
        parse_extensions(args.extensions)
    except CorpusError as err:
        problems.append(str(err))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out} exists and is not a folder")
    elif not args.overwrite:
        earlier = [n for n in OUTPUT_NAMES if (out / n).exists()]
        if earlier:
            problems.append(f"--out {out} already holds {', '.join(earlier)}; pass --overwrite "
                            "to replace them, or choose another folder")
    if problems:
        raise CorpusError("; ".join(problems))


def _extension(path: Path) -> str:
    return path.suffix.lower().lstrip(".") or NO_EXTENSION


def gather(sources: Sequence[str], extensions: Sequence[str], max_file_bytes: int,
           progress: bool) -> "tuple[List[KeptFile], Dict[str, int]]":
    """The text files to keep, in walk order (first copy of identical files), and skip counts."""
    from tqdm import tqdm

    from megatron_dmoe.data.documents import list_input_files
    from megatron_dmoe.data.errors import DataError

    try:
        files = list_input_files(sources)
    except DataError as err:
        raise CorpusError(str(err)) from None
    wanted = set(extensions)
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    kept: List[KeptFile] = []
    seen, seen_paths = set(), set()
    for path in tqdm(files, desc="gathering", unit="file", disable=not progress):
        real = os.path.realpath(path)
        if real in seen_paths:  # one folder given inside another: the same file twice
            continue
        seen_paths.add(real)
        if _extension(path) not in wanted:
            skipped["extension"] += 1
            continue
        try:
            size = path.stat().st_size
            if size > max_file_bytes:
                skipped["too_large"] += 1
                continue
            data = path.read_bytes()
        except OSError:
            skipped["unreadable"] += 1
            continue
        reason = _text_problem(data)
        if reason:
            skipped[reason] += 1
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        kept.append(KeptFile(path, digest, len(data)))
    return kept, skipped


def _text_problem(data: bytes) -> Optional[str]:
    if b"\0" in data:
        return "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "undecodable"
    # a document of only whitespace teaches nothing, and an empty one is not written at all
    return "empty" if not text.strip() else None


def hash_key(sha256: str, seed: int) -> float:
    """A number in [0, 1) fixed by the file's content and the seed: the split and sample order."""
    digest = hashlib.sha256(f"{seed}:{sha256}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def cap_total(kept: List[KeptFile], max_total_bytes: int, seed: int) -> List[KeptFile]:
    """The files that fit in `max_total_bytes`, taken in hash order; walk order is kept."""
    chosen, total = set(), 0
    for f in sorted(kept, key=lambda f: hash_key(f.sha256, seed)):
        if total + f.size > max_total_bytes:
            break
        chosen.add(f.sha256)
        total += f.size
    return [f for f in kept if f.sha256 in chosen]


def assign_splits(kept: List[KeptFile], valid_fraction: float, seed: int) -> None:
    """Held out: files whose hash key is below valid_fraction; each split gets at least one."""
    if len(kept) < 2:
        raise CorpusError(f"{len(kept)} file(s) kept: at least 2 are needed, one per split; "
                          "give more folders or a wider --extensions list")
    for f in kept:
        f.split = "valid" if hash_key(f.sha256, seed) < valid_fraction else "train"
    by_key = sorted(kept, key=lambda f: hash_key(f.sha256, seed))
    if not any(f.split == "valid" for f in kept):
        by_key[0].split = "valid"
    if not any(f.split == "train" for f in kept):
        by_key[-1].split = "train"


def write_jsonl(kept: List[KeptFile], out: Path, progress: bool) -> Dict[str, Path]:
    from tqdm import tqdm

    paths = {s: out / f"corpus_{s}.jsonl" for s in SPLITS}
    handles = {s: open(p, "w", encoding="utf-8") for s, p in paths.items()}
    try:
        for f in tqdm(kept, desc="writing jsonl", unit="file", disable=not progress):
            text = f.path.read_bytes().decode("utf-8")
            record = {"text": text, "path": str(f.path), "sha256": f.sha256}
            handles[f.split].write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        for h in handles.values():
            h.close()
    return paths


def tokenizer_sample(kept: List[KeptFile], sample_bytes: int, seed: int) -> List[str]:
    """Training files' texts in hash order, up to about `sample_bytes` (at least one file)."""
    texts, total = [], 0
    for f in sorted((f for f in kept if f.split == "train"), key=lambda f: hash_key(f.sha256, seed)):
        if texts and total + f.size > sample_bytes:
            break
        texts.append(f.path.read_bytes().decode("utf-8"))
        total += f.size
    return texts


def make_corpus(args) -> dict:
    """Run the whole recipe; returns the summary also written to OUT/summary.json."""
    check_args(args)
    # imported after the checks so that --help and argument errors answer at once; megatron-core
    # warns on import about optional accelerators that this tool does not use
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron_dmoe.data.errors import DataError
    from megatron_dmoe.data.preprocess import preprocess_data
    from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer, train_tokenizer

    progress = not args.no_progress
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    kept, skipped = gather(args.sources, parse_extensions(args.extensions),
                           int(args.max_file_kib * 1024), progress)
    if args.max_total_mib is not None:
        capped = cap_total(kept, int(args.max_total_mib * MIB), args.seed)
        skipped["over_total_cap"] = len(kept) - len(capped)
        kept = capped
    assign_splits(kept, args.valid_fraction, args.seed)
    seconds["gather"] = time.perf_counter() - start

    start = time.perf_counter()
    jsonl = write_jsonl(kept, out, progress)
    seconds["write_jsonl"] = time.perf_counter() - start

    start = time.perf_counter()
    sample_bytes = None
    if args.tokenizer_model is None:
        texts = tokenizer_sample(kept, int(args.tokenizer_sample_mib * MIB), args.seed)
        sample_bytes = sum(len(t.encode("utf-8")) for t in texts)
        print(f"training a {args.vocab_size}-piece tokenizer on {len(texts)} training files "
              f"({sample_bytes / MIB:.1f} MiB) with {args.workers} threads", flush=True)
        try:
            model = train_tokenizer(texts, args.vocab_size, out / "tokenizer",
                                    model_type=args.model_type,
                                    input_sentence_size=args.tokenizer_sentences,
                                    num_threads=args.workers, seed=args.seed)
        except DataError as err:
            raise CorpusError(str(err)) from None
        del texts
    else:
        model = args.tokenizer_model
    vocab_size = load_tokenizer(model).vocab_size
    seconds["tokenizer"] = time.perf_counter() - start

    start = time.perf_counter()
    stats = {}
    for split in SPLITS:
        try:
            written = preprocess_data([str(jsonl[split])], str(out / split), str(model),
                                      workers=args.workers, progress=progress)
        except DataError as err:
            raise CorpusError(str(err)) from None
        stats[split] = written["text"]
    seconds["tokenise"] = time.perf_counter() - start

    prefixes = {s: stats[s].prefix for s in SPLITS}
    summary = {
        "sources": [str(s) for s in args.sources],
        "settings": {k: v for k, v in vars(args).items() if k not in ("sources", "no_progress")},
        "files": {"kept": len(kept), "skipped": skipped},
        "documents": {s: stats[s].documents for s in SPLITS},
        "bytes": {s: sum(f.size for f in kept if f.split == s) for s in SPLITS},
        "tokens": {s: stats[s].tokens for s in SPLITS},
        "tokenizer": {"model": str(model), "vocab_size": vocab_size,
                      "trained_on_bytes": sample_bytes},
        "jsonl": {s: str(jsonl[s]) for s in SPLITS},
        "data": prefixes,
        "overrides": [f"data.data_path=[{prefixes['train']}]",
                      f"data.valid_data_path=[{prefixes['valid']}]",
                      f"data.tokenizer_model={model}"],
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = make_corpus(args)
    except CorpusError as err:
        print(f"make_corpus: error: {err}", file=sys.stderr)
        return 2
    skipped = ", ".join(f"{n} {reason}" for reason, n in summary["files"]["skipped"].items() if n)
    print(f"kept {summary['files']['kept']} files" + (f" (skipped: {skipped})" if skipped else ""))
    for split in SPLITS:
        print(f"{split}: {summary['documents'][split]} documents, "
              f"{summary['bytes'][split] / MIB:.1f} MiB, {summary['tokens'][split]:,} tokens "
              f"-> {summary['data'][split]}.bin/.idx")
    print(f"summary: {Path(args.out) / 'summary.json'}")
    print("train with: dmoe-train CONFIG " + " ".join(summary["overrides"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
