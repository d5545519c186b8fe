"""data.valid_data_path: validation samples come only from their own files, training samples from
all of data.data_path (data.split unused), and mistakes name the key."""
import pytest

from megatron_dmoe.config import find_problems, load_config
from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.data.datasets import build_datasets
from megatron_dmoe.data.errors import DataError

SEQ = 16


def _config(train, valid, model):
    cfg = RunConfig()
    cfg.model.seq_length = SEQ
    cfg.data.data_path = [train]
    cfg.data.valid_data_path = [valid] if valid else []
    cfg.data.tokenizer_model = str(model)
    return cfg


def _tokens_of(dataset):
    seen = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        seen.update(sample["tokens"].tolist() + sample["labels"][-1:].tolist())
    return seen


def test_validation_samples_come_from_their_own_files(tmp_path, tiny_model, tiny_tokenizer,
                                                      write_dataset, numbered_docs):
    eod = tiny_tokenizer.eod
    train_docs = numbered_docs(10, [9, 14, 7, 20, 11], eod)  # ids 10..70
    valid_docs = numbered_docs(200, [13, 8, 17], eod)  # ids 200..237
    train = write_dataset(tmp_path / "train_text_document", train_docs)
    valid = write_dataset(tmp_path / "valid_text_document", valid_docs)
    cfg = _config(train, valid, tiny_model)
    cfg.data.split = "1,0,0"  # would leave nothing to validate on if it were used
    train_set, valid_set, test_set = build_datasets(cfg, tiny_tokenizer, (40, 10, 0))
    assert test_set is None
    train_ids = {t for d in train_docs for t in d[:-1]}
    valid_ids = {t for d in valid_docs for t in d[:-1]}
    assert _tokens_of(valid_set) - {eod} <= valid_ids
    assert _tokens_of(train_set) - {eod} == train_ids, "every training document is used"


def test_missing_validation_files_name_the_key(tmp_path, tiny_model, tiny_tokenizer,
                                               write_dataset, numbered_docs):
    train = write_dataset(tmp_path / "train_text_document",
                          numbered_docs(10, [9, 14], tiny_tokenizer.eod))
    cfg = _config(train, str(tmp_path / "nowhere_text_document"), tiny_model)
    with pytest.raises(DataError, match=r"data\.valid_data_path") as err:
        build_datasets(cfg, tiny_tokenizer, (10, 10, 0))
    assert "nowhere_text_document.bin" in str(err.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["data.valid_data_path=[v_text_document]"], "data.data_path is empty"),
    (["data.data_path=[t]", "data.valid_data_path=[x,v]"], "should be a weight"),
])
def test_config_check_of_valid_data_path(overrides, fragment):
    problems = find_problems(load_config("tiny", overrides))
    assert [key for key, _ in problems] == ["data.valid_data_path"], problems
    assert fragment in problems[0][1]


@pytest.mark.parametrize("value, ok", [("30", True), ("0.5", True), ("0", False), ("-1", False),
                                       ("null", True)])
def test_config_check_of_time_limit(value, ok):
    problems = find_problems(load_config("tiny", [f"training.time_limit_minutes={value}"]))
    keys = [key for key, _ in problems]
    assert keys == ([] if ok else ["training.time_limit_minutes"]), problems
