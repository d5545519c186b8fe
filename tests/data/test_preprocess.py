"""Preprocessing into indexed datasets: exact round trips, counts, worker independence, inputs
of every kind, and clear errors."""
import json
import os

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.preprocess import preprocess_data


def _read_back(prefix, tokenizer):
    """(texts, token counts) of every stored document; each must end with the eod token."""
    ds = IndexedDataset(prefix)
    texts, counts = [], []
    for i in range(len(ds)):
        ids = ds[i]
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        texts.append(tokenizer.detokenize(ids[:-1]))
        counts.append(len(ids))
    return texts, counts


def test_jsonl_round_trip(tmp_path, tiny_model, tiny_tokenizer, rng, random_text):
    docs = [random_text(rng) for _ in range(40)]
    docs[3] = docs[17] = ""
    docs[25] = None
    with open(tmp_path / "in.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            # both JSON spellings of non-ASCII text: escaped and raw UTF-8
            f.write(json.dumps({"text": d, "id": i}, ensure_ascii=bool(i % 2)) + "\n")
        f.write("\n")  # a blank line is no record
    stats = preprocess_data([tmp_path / "in.jsonl"], str(tmp_path / "out"), tiny_model,
                            progress=False)["text"]
    kept = [d for d in docs if d]
    assert stats.prefix == str(tmp_path / "out_text_document")
    assert (stats.documents, stats.skipped) == (len(kept), 3)
    texts, counts = _read_back(stats.prefix, tiny_tokenizer)
    assert texts == kept, f"seed {rng.seed_}"
    assert counts == [len(tiny_tokenizer.tokenize(d)) + 1 for d in kept]
    assert stats.tokens == sum(counts)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin",
                                            "out_text_document.idx"]


def test_workers_write_the_same_files(tmp_path, tiny_model, rng, random_text):
    # more documents than one worker task holds, so the work is really spread
    with open(tmp_path / "in.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": random_text(rng, 60) if rng.random() > 0.1 else ""}) + "\n")
    one = preprocess_data([tmp_path / "in.jsonl"], str(tmp_path / "w1"), tiny_model, workers=1,
                          progress=False)["text"]
    two = preprocess_data([tmp_path / "in.jsonl"], str(tmp_path / "w2"), tiny_model, workers=2,
                          progress=False)["text"]
    assert (one.documents, one.skipped, one.tokens) == (two.documents, two.skipped, two.tokens)
    for suffix in (".bin", ".idx"):
        with open(one.prefix + suffix, "rb") as a, open(two.prefix + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


def test_text_files_and_folders(tmp_path, tiny_model, tiny_tokenizer, rng, random_text):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    contents = {
        folder / "b.txt": "second file\r\nwith CRLF endings\r\n",
        folder / "sub" / "a.md": random_text(rng) + "\n\nlast line without newline",
        folder / "a.txt": "first file: ünï 日本\n\n  indented\n",
        folder / "empty.txt": "",
        folder / ".hidden": "never read",
    }
    for path, text in contents.items():
        path.write_bytes(text.encode("utf-8"))
    order = [folder / "a.txt", folder / "b.txt", folder / "empty.txt", folder / "sub" / "a.md"]

    whole = preprocess_data([folder], str(tmp_path / "whole"), tiny_model, progress=False)["text"]
    texts, _ = _read_back(whole.prefix, tiny_tokenizer)
    assert texts == [contents[p] for p in order if contents[p]], f"seed {rng.seed_}"
    assert whole.skipped == 1

    lines = preprocess_data([folder], str(tmp_path / "lines"), tiny_model, split_lines=True,
                            progress=False)["text"]
    texts, _ = _read_back(lines.prefix, tiny_tokenizer)
    # expected lines, split independently of the reader: on \r\n, \n or \r
    expected = []
    for p in order:
        raw = contents[p].replace("\r\n", "\n").replace("\r", "\n")
        if raw:  # an empty file has no lines
            expected.extend(raw.split("\n")[:-1] if raw.endswith("\n") else raw.split("\n"))
    assert texts == [line for line in expected if line], f"seed {rng.seed_}"
    assert lines.skipped == sum(1 for line in expected if not line)

    only_md = preprocess_data([folder], str(tmp_path / "md"), tiny_model, glob="*.md",
                              progress=False)["text"]
    assert _read_back(only_md.prefix, tiny_tokenizer)[0] == [contents[folder / "sub" / "a.md"]]


def test_several_json_keys(tmp_path, tiny_model, tiny_tokenizer):
    records = [{"title": "T1", "body": "first body"}, {"title": "", "body": "second body"},
               {"title": "T3", "body": None}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    stats = preprocess_data([tmp_path / "in.jsonl"], str(tmp_path / "o"), tiny_model,
                            json_keys=["title", "body"], progress=False)
    assert _read_back(str(tmp_path / "o_title_document"), tiny_tokenizer)[0] == ["T1", "T3"]
    assert _read_back(str(tmp_path / "o_body_document"), tiny_tokenizer)[0] == \
        ["first body", "second body"]
    assert (stats["title"].skipped, stats["body"].skipped) == (1, 1)


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"body": "no text key"}\n', r"in.jsonl line 2: no key 'text'.*'body'"),
    ('{"text": "ok"}\n{"text": "unterminated\n', r"in.jsonl line 2: not valid JSON"),
    ('["a list"]\n', r"in.jsonl line 1: expected a JSON object"),
    ('{"text": 5}\n', r"line 1: 'text' holds int, not text"),
    ('{"text": ""}\n{"text": null}\n', r"no documents for .*all 2 were empty"),
])
def test_bad_jsonl(tmp_path, tiny_model, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        preprocess_data([tmp_path / "in.jsonl"], str(tmp_path / "o"), tiny_model, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"], "a failed run must leave no dataset files"


def test_bad_inputs(tmp_path, tiny_model):
    with pytest.raises(DataError, match=f"input not found: {tmp_path / 'missing.jsonl'}"):
        preprocess_data([tmp_path / "missing.jsonl"], str(tmp_path / "o"), tiny_model)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8 text"):
        preprocess_data([tmp_path / "latin1.txt"], str(tmp_path / "o"), tiny_model)
    with pytest.raises(DataError, match="tokenizer model not found"):
        preprocess_data([tmp_path / "latin1.txt"], str(tmp_path / "o"), tmp_path / "no.model")
