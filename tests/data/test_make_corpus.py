"""tools/make_corpus.py on a tiny generated tree: which files are kept, a split by document that is
deterministic and independent of location, and token counts that decode back to the files."""
import hashlib
import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_corpus.py"
WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "value", "items",
         "total", "name", "=", "+", "(", ")", ":", "é", "数据", "print", "0", "1", "42"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("make_corpus", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _text(rng, lines):
    return "".join("    " * rng.randint(0, 2) + " ".join(rng.choices(WORDS, k=rng.randint(2, 9)))
                   + "\n" for _ in range(lines))


def make_tree(root: Path):
    """A few dozen files; returns {relative path: text} of those the tool must keep (each
    distinct content once, its first path in sorted walk order)."""
    rng = random.Random(7)
    keep = {}
    for i in range(36):
        rel = Path(f"pkg{i % 4}") / ("sub" if i % 3 else "") / f"mod{i:02d}.{('py', 'rst', 'h')[i % 3]}"
        text = _text(rng, rng.randint(5, 30))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
        keep[rel.as_posix()] = text
    # a copy of pkg0's first module later in walk order: kept once, under the first path
    shutil.copy(root / "pkg0" / "mod00.py", root / "pkg3" / "zz_copy.py")
    (root / "pkg1" / "empty.py").write_text("  \n\n", encoding="utf-8")
    (root / "pkg1" / "blob.h").write_bytes(b"int x;\0\x01\x02")
    (root / "pkg1" / "latin1.txt").write_bytes("caf\xe9 na\xefve".encode("latin-1"))
    (root / "pkg2" / "big.py").write_text("x = 1\n" * 400, encoding="utf-8")  # 2.4 KB > 2 KiB cap
    (root / "pkg2" / "data.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    (root / "pkg2" / ".hidden.py").write_text("secret = 1\n", encoding="utf-8")
    return keep


def _records(out: Path, split: str):
    lines = (out / f"corpus_{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _run(tool, *args):
    return tool.main([*map(str, args), "--no-progress", "--max-file-kib", "2"])


def test_make_corpus_splits_by_file_and_counts_tokens(tool, tmp_path, capsys):
    tree = tmp_path / "tree"
    keep = make_tree(tree)
    out = tmp_path / "out"
    # pkg1 again inside tree: its files are read once, not counted as duplicates
    assert _run(tool, tree, tree / "pkg1", "--out", out, "--vocab-size", "300",
                "--valid-fraction", "0.25", "--workers", "2") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"]["kept"] == len(keep)
    assert {k: v for k, v in summary["files"]["skipped"].items() if v} == {
        "extension": 1, "too_large": 1, "empty": 1, "binary": 1, "undecodable": 1, "duplicate": 1}

    # every kept file exactly once across the splits, held out by the hash of its content
    records = {s: _records(out, s) for s in ("train", "valid")}
    paths = [Path(r["path"]).relative_to(tree).as_posix() for s in records for r in records[s]]
    assert sorted(paths) == sorted(keep)
    for split, recs in records.items():
        for r in recs:
            assert r["text"] == keep[Path(r["path"]).relative_to(tree).as_posix()]
            digest = hashlib.sha256(r["text"].encode()).hexdigest()
            key = int.from_bytes(hashlib.sha256(f"0:{digest}".encode()).digest()[:8], "big") / 2**64
            assert (key < 0.25) == (split == "valid")
    assert 0 < len(records["valid"]) < len(keep) // 2

    # each split's dataset holds its files' documents in order, each decoding back to the file
    tokenizer = load_tokenizer(str(out / "tokenizer.model"))
    for split in ("train", "valid"):
        dataset = IndexedDataset(str(out / f"{split}_text_document"))
        assert len(dataset) == summary["documents"][split] == len(records[split])
        total = 0
        for i, record in enumerate(records[split]):
            ids = np.asarray(dataset[i])
            assert ids[-1] == tokenizer.eod
            assert tokenizer.detokenize(ids[:-1]) == record["text"]
            total += len(ids)
        assert total == summary["tokens"][split]
    printed = capsys.readouterr().out
    assert f"train: {len(records['train'])} documents" in printed
    assert f"{summary['tokens']['valid']:,} tokens" in printed
    assert f"data.valid_data_path=[{out / 'valid_text_document'}]" in printed

    # the same files elsewhere, given as two folders, split the same way (tokenizer reused)
    moved = tmp_path / "moved"
    shutil.copytree(tree / "pkg2", moved / "b" / "pkg2")
    shutil.copytree(tree, moved / "a", ignore=shutil.ignore_patterns("pkg2"))
    again = tmp_path / "again"
    assert _run(tool, moved / "b", moved / "a", "--out", again, "--valid-fraction", "0.25",
                "--tokenizer-model", out / "tokenizer.model", "--workers", "1") == 0
    for split in ("train", "valid"):
        assert sorted(r["sha256"] for r in _records(again, split)) == \
            sorted(r["sha256"] for r in records[split])
    assert json.loads((again / "summary.json").read_text())["tokens"] == summary["tokens"]


def test_total_cap_and_bad_arguments(tool, tmp_path, capsys):
    tree = tmp_path / "tree"
    keep = make_tree(tree)
    out = tmp_path / "out"
    # bad input: one error naming each problem, nothing written
    assert _run(tool, tree, tmp_path / "missing", "--out", out, "--valid-fraction", "1.5",
                "--vocab-size", "100") == 2
    err = capsys.readouterr().err
    assert "missing' does not exist" in err and "--valid-fraction 1.5" in err
    assert "--vocab-size 100" in err
    assert not out.exists()
    cap = sum(len(t.encode()) for t in keep.values()) // 2
    assert _run(tool, tree, "--out", out, "--vocab-size", "300", "--max-total-mib",
                cap / 2**20, "--workers", "1") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sum(summary["bytes"].values()) <= cap
    assert summary["files"]["kept"] + summary["files"]["skipped"]["over_total_cap"] == len(keep)
    assert summary["files"]["skipped"]["over_total_cap"] > 0
    # outputs of an earlier run are not replaced without --overwrite
    assert _run(tool, tree, "--out", out) == 2
    assert "--overwrite" in capsys.readouterr().err
