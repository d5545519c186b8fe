"""Missing, corrupt and mismatched data: each raises one DataError that names the file or key."""
import os
import shutil

import pytest

from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.data.checks import (
    check_data_files,
    check_splits,
    check_tokenizer_matches,
    split_matrix,
)
from megatron_dmoe.data.datasets import build_datasets
from megatron_dmoe.data.errors import DataError, DataWarning


@pytest.fixture
def dataset(tmp_path, tiny_tokenizer, write_dataset, numbered_docs, rng):
    # ids count up from 5 over all documents: at most 20 x 18 of them stay inside the 400-piece tokenizer
    lengths = [rng.randint(1, 18) for _ in range(20)]
    docs = numbered_docs(5, lengths, tiny_tokenizer.eod)
    return write_dataset(tmp_path / "good_text_document", docs), docs


def _copy(prefix, new_prefix):
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, new_prefix + suffix)
    return new_prefix


def test_good_files_pass(dataset):
    prefix, docs = dataset
    (info,) = check_data_files([prefix])
    assert info.num_documents == len(docs)
    assert info.num_tokens == sum(len(d) for d in docs)
    assert list(info.sequence_lengths) == [len(d) for d in docs]


def test_missing_files_are_all_named(tmp_path, dataset, tiny_model, tiny_tokenizer):
    prefix, _ = dataset
    half = str(tmp_path / "half_text_document")
    shutil.copy(prefix + ".idx", half + ".idx")
    absent = str(tmp_path / "absent_text_document")
    with pytest.raises(DataError) as err:
        check_data_files([prefix, half, absent])
    message = str(err.value)
    for path in (half + ".bin", absent + ".bin", absent + ".idx"):
        assert path in message
    assert half + ".idx" not in message and prefix not in message.replace(half, "")
    assert "tools/preprocess_data.py" in message and "data.data_path" in message
    # build_datasets checks before megatron-core sees the files
    cfg = RunConfig()
    cfg.data.data_path = [absent]
    cfg.data.tokenizer_model = tiny_model
    with pytest.raises(DataError, match="data files not found"):
        build_datasets(cfg, tiny_tokenizer, (10, 1, 1))


def test_prefix_with_extension_gets_a_hint(dataset):
    prefix, _ = dataset
    with pytest.raises(DataError, match="without .bin/.idx"):
        check_data_files([prefix + ".bin"])


def test_truncated_bin(tmp_path, dataset):
    bad = _copy(dataset[0], str(tmp_path / "short_text_document"))
    size = os.path.getsize(bad + ".bin")
    os.truncate(bad + ".bin", size - 6)
    with pytest.raises(DataError, match=f"corrupt data file {bad}.bin: .* truncated"):
        check_data_files([bad])


def test_garbage_idx(tmp_path, dataset, rng):
    bad = _copy(dataset[0], str(tmp_path / "garbage_text_document"))
    size = os.path.getsize(bad + ".idx")
    with open(bad + ".idx", "wb") as f:
        f.write(bytes(rng.randrange(256) for _ in range(size)))
    with pytest.raises(DataError, match=f"corrupt data file {bad}.idx: it does not start like"):
        check_data_files([bad])


def test_truncated_idx(tmp_path, dataset):
    bad = _copy(dataset[0], str(tmp_path / "cut_text_document"))
    os.truncate(bad + ".idx", os.path.getsize(bad + ".idx") - 8)
    with pytest.raises(DataError, match=f"corrupt data file {bad}.idx: it is .* bytes"):
        check_data_files([bad])


def test_bin_and_idx_of_different_data(tmp_path, dataset, write_dataset, numbered_docs,
                                       tiny_tokenizer):
    other = write_dataset(tmp_path / "other_text_document",
                          numbered_docs(5, [40, 40], tiny_tokenizer.eod))
    mixed = str(tmp_path / "mixed_text_document")
    shutil.copy(dataset[0] + ".idx", mixed + ".idx")
    shutil.copy(other + ".bin", mixed + ".bin")
    with pytest.raises(DataError, match=f"{mixed}.bin: .* different runs"):
        check_data_files([mixed])


def test_split_without_documents(tmp_path, write_dataset, numbered_docs, tiny_tokenizer):
    few = write_dataset(tmp_path / "few_text_document",
                        numbered_docs(5, [10, 10, 10], tiny_tokenizer.eod))
    infos = check_data_files([few])
    with pytest.raises(DataError) as err:
        check_splits(infos, "969,30,1")
    message = str(err.value)
    assert "data.split='969,30,1'" in message and "valid split gets 0 of its 3" in message
    assert "test split gets 0 of its 3" in message and few in message
    check_splits(infos, "1,1,1")  # one document each: fine
    check_splits(infos, "2,1,0")  # test turned off: fine
    # splits training does not read may be empty: a warning, and they are returned to be left out
    with pytest.warns(DataWarning, match="leaves the test split without documents, which this run does not read"):
        assert check_splits(infos, "5,4,1", read=(True, True, False)) == [2]
    with pytest.raises(DataError, match="valid split gets 0 of its 3"):
        check_splits(infos, "969,30,1", read=(True, True, False))  # valid is read
    with pytest.raises(DataError, match="data.split='a,b'"):
        split_matrix("a,b")


def test_model_vocabulary_smaller_than_tokenizer(tiny_tokenizer):
    check_tokenizer_matches(tiny_tokenizer, 400)
    check_tokenizer_matches(tiny_tokenizer, None)
    with pytest.raises(DataError) as err:
        check_tokenizer_matches(tiny_tokenizer, 384)
    message = str(err.value)
    assert "model.vocab_size=384" in message and "400 tokens" in message
    assert f"data.tokenizer_model={tiny_tokenizer.path}" in message


def test_data_from_a_larger_tokenizer(tmp_path, write_dataset, dataset, tiny_tokenizer):
    check_tokenizer_matches(tiny_tokenizer, 512, [dataset[0]])
    foreign = write_dataset(tmp_path / "foreign_text_document", [[5, 1000, 7, 2], [8, 2]],
                            vocab_size=2000)
    with pytest.raises(DataError) as err:
        check_tokenizer_matches(tiny_tokenizer, 512, [dataset[0], foreign])
    message = str(err.value)
    assert f"{foreign}.bin holds token id 1000" in message and "400 tokens" in message
    assert "data.tokenizer_model" in message
