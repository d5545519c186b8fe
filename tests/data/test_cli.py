"""tools/train_tokenizer.py and tools/preprocess_data.py: every flag explained, and a run from
raw text to a dataset that reads back."""
import importlib.util
import json
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["train_tokenizer", "preprocess_data"])
def test_help_explains_every_flag(name, capsys):
    parser = _tool(name).build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in text


def test_raw_text_to_dataset(tmp_path, capsys, train_text):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in train_text + [""]))
    assert _tool("train_tokenizer").main(
        ["--input", str(corpus), "--vocab-size", "400", "--out-prefix", str(tmp_path / "tok")]) == 0
    assert _tool("preprocess_data").main(
        ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--tokenizer-model",
         str(tmp_path / "tok.model"), "--workers", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{len(train_text)} documents" in out and "1 empty skipped" in out
    tok = load_tokenizer(tmp_path / "tok.model")
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == train_text


def test_errors_are_one_line_without_traceback(tmp_path, capsys):
    code = _tool("preprocess_data").main(
        ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o"),
         "--tokenizer-model", str(tmp_path / "nope.model")])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "nope.model" in err
