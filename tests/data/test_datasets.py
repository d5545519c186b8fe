"""build_datasets over megatron-core's GPTDataset: windows of seq_length + 1 tokens from the
right split, blending by weight, the built-in corpus, and torch.distributed on two ranks."""
import multiprocessing
import os

import pytest
import torch

from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.data.datasets import build_datasets, build_tokenizer, parse_blend
from megatron_dmoe.data.errors import DataError, DataWarning
from megatron_dmoe.data.loader import build_loader

SEQ = 16


def _config(data_path, model, split="50,25,25", seed=1234):
    cfg = RunConfig()
    cfg.model.seq_length = SEQ
    cfg.data.data_path = list(data_path)
    cfg.data.tokenizer_model = str(model)
    cfg.data.split = split
    cfg.training.seed = seed
    return cfg


def _assert_window_of(window, docs, eod):
    """`window` must read straight through documents of `docs`, jumping only after an eod."""
    owner = {t: d for d, doc in enumerate(docs) for t in doc[:-1]}
    starts = {doc[0] for doc in docs}
    assert all(t == eod or t in owner for t in window), "token from outside the split"
    for a, b in zip(window[:-1], window[1:]):
        if a == eod:
            assert b in starts, "after a document ends, another must start"
        else:
            assert b == a + 1 or (b == eod and a == docs[owner[a]][-2]), (a, b)


@pytest.fixture
def twelve_docs(tmp_path, tiny_tokenizer, write_dataset, numbered_docs, rng):
    lengths = [rng.randint(3, 25) for _ in range(12)]
    docs = numbered_docs(10, lengths, tiny_tokenizer.eod)
    return write_dataset(tmp_path / "a_text_document", docs), docs


def test_samples_are_shifted_windows_of_their_split(twelve_docs, tiny_model, tiny_tokenizer):
    prefix, docs = twelve_docs
    cfg = _config([prefix], tiny_model)
    train, valid, test = build_datasets(cfg, tiny_tokenizer, (50, 10, 10))
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 10
    eod = tiny_tokenizer.eod
    # split "50,25,25" of 12 documents: 6 train, 3 valid, 3 test, in stored order
    for dataset, split_docs in ((train, docs[:6]), (valid, docs[6:9]), (test, docs[9:])):
        for i in range(len(dataset)):
            s = dataset[i]
            assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
            assert s["tokens"].shape == s["labels"].shape == (SEQ,)
            assert s["tokens"].dtype == s["labels"].dtype == torch.long
            assert torch.equal(s["tokens"][1:], s["labels"][:-1]), "labels are tokens shifted"
            assert torch.equal(s["loss_mask"], torch.ones(SEQ))
            assert torch.equal(s["position_ids"], torch.arange(SEQ))
            window = s["tokens"].tolist() + s["labels"][-1:].tolist()
            _assert_window_of(window, split_docs, eod)
    # the same seed rebuilds the same samples (from megatron-core's index cache or not)
    again, _, _ = build_datasets(cfg, tiny_tokenizer, (50, 10, 10))
    assert all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(len(train)))


def test_a_run_waits_while_another_writes_the_index_cache(twelve_docs, tiny_model, tiny_tokenizer):
    """Runs started together on one data folder (a concurrent sweep): the index files are built by
    one writer at a time, so none reads a half-written file."""
    import fcntl
    import threading

    prefix, _ = twelve_docs
    cfg = _config([prefix], tiny_model)
    cache = os.path.join(os.path.dirname(prefix), "index_cache")
    os.makedirs(cache, exist_ok=True)
    built = {}
    with open(os.path.join(cache, ".lock"), "a") as other_writer:
        fcntl.flock(other_writer, fcntl.LOCK_EX)
        def build():
            built["train"] = build_datasets(cfg, tiny_tokenizer, (50, 10, 10))[0]

        thread = threading.Thread(target=build)
        thread.start()
        thread.join(5.0)  # unlocked, the tiny build ends well within this
        assert thread.is_alive() and not built, "the build did not wait for the other writer"
        assert not [f for f in os.listdir(cache) if f.endswith(".npy")], "index files written under the lock"
        fcntl.flock(other_writer, fcntl.LOCK_UN)
    thread.join(60)
    assert len(built["train"]) >= 50


def test_sixty_documents_train_with_the_default_split(tmp_path, tiny_model, tiny_tokenizer, write_dataset,
                                                      numbered_docs):
    """The default '969,30,1' leaves the test split of 60 documents empty; training never reads it."""
    prefix = write_dataset(tmp_path / "sixty_text_document", numbered_docs(10, [5] * 60, tiny_tokenizer.eod))
    cfg = _config([prefix], tiny_model, split=RunConfig().data.split)
    with pytest.warns(DataWarning, match="test split without documents"):
        train, valid, test = build_datasets(cfg, tiny_tokenizer, (20, 4, 0))
    assert test is None and len(train) >= 20 and len(valid) >= 4
    with pytest.raises(DataError, match="test split gets 0 of its 60"):  # asked for: refused
        build_datasets(cfg, tiny_tokenizer, (20, 4, 1))


def test_blending_two_prefixes(tmp_path, tiny_model, tiny_tokenizer, write_dataset,
                               numbered_docs):
    eod = tiny_tokenizer.eod
    docs_a = numbered_docs(10, [12] * 10, eod)
    docs_b = numbered_docs(200, [15] * 10, eod)
    a = write_dataset(tmp_path / "a_text_document", docs_a)
    b = write_dataset(tmp_path / "b_text_document", docs_b)
    cfg = _config(["0.25", a, "0.75", b], tiny_model, split="80,20,0")
    train, valid, test = build_datasets(cfg, tiny_tokenizer, (200, 40, 0))
    assert test is None, "a split of weight 0 is not built"
    assert len(train) == 200 and len(valid) == 40
    from_a = 0
    for i in range(len(train)):
        sample = train[i]
        window = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        source = docs_a[:8] if sample["dataset_id"] == 0 else docs_b[:8]
        _assert_window_of(window, source, eod)
        from_a += int(sample["dataset_id"] == 0)
    assert abs(from_a - 50) <= 2, f"{from_a} of 200 samples from the 0.25 prefix"


def test_builtin_corpus_when_data_path_is_empty(tmp_path, monkeypatch):
    import megatron_dmoe.data.builtin as builtin

    monkeypatch.setattr(builtin, "DEFAULT_MAX_BYTES", 120_000)
    cfg = RunConfig()
    cfg.model.seq_length = SEQ
    cfg.data.builtin_vocab_size = 512
    cfg.data.cache_dir = str(tmp_path)
    cfg.data.split = "90,10,0"
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.vocab_size == 512 and str(tmp_path) in tokenizer.path
    train, valid, _ = build_datasets(cfg, tokenizer, (64, 8, 0))
    text = tokenizer.detokenize(train[0]["tokens"])
    assert len(train) >= 64 and text.strip(), "samples decode to source text"
    assert any(name.startswith("builtin-") for name in os.listdir(tmp_path))


def test_tokenizer_settings_must_match_the_data(tmp_path, tiny_model):
    cfg = RunConfig()
    cfg.data.data_path = [str(tmp_path / "x_text_document")]
    with pytest.raises(DataError, match="data.data_path is set but no tokenizer is"):
        build_tokenizer(cfg)
    cfg.data.tokenizer_model = str(tmp_path / "missing.model")
    with pytest.raises(DataError, match=r"data.tokenizer_model: tokenizer model not found"):
        build_tokenizer(cfg)
    cfg.data.data_path = []
    with pytest.raises(DataError, match="built-in corpus comes with its own tokenizer"):
        build_tokenizer(cfg)


@pytest.mark.parametrize("data_path, blend", [
    (["data/a"], (["data/a"], None)),
    (["data/a", "data/b"], (["data/a", "data/b"], None)),
    (["0.3", "data/a", "0.7", "data/b"], (["data/a", "data/b"], [0.3, 0.7])),
    ([30, "data/a", 70, "data/b"], (["data/a", "data/b"], [30.0, 70.0])),
])
def test_parse_blend(data_path, blend):
    assert parse_blend(data_path) == blend


@pytest.mark.parametrize("data_path", [["0.3", "data/a", "data/b"], ["0.3", "0.7"],
                                       ["-1", "data/a", "2", "data/b"]])
def test_parse_blend_rejects(data_path):
    with pytest.raises(DataError, match="data.data_path"):
        parse_blend(data_path)


def _rank_main(rank, prefix, model, rendezvous, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}",
                                         rank=rank, world_size=2)
    try:
        from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model)
        train, _, _ = build_datasets(_config([prefix], model), tokenizer, (40, 8, 8))
        loader = build_loader(train, 2, 0, rank, 2, 0, 1234)
        # plain lists: tensors would travel as shared memory that dies with this process
        batches = [next(loader)["tokens"].tolist() for _ in range(4)]
        samples = [train[i]["tokens"].tolist() for i in range(len(train))]
        results.put((rank, len(train), samples, batches))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_with_torch_distributed(twelve_docs, tiny_model, tmp_path):
    prefix, _ = twelve_docs
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, prefix, tiny_model, tmp_path / "rendezvous", results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (len0, samples0, batches0), (len1, samples1, batches1) = got[0], got[1]
    assert len0 == len1 and samples0 == samples1, "every rank must see the same dataset"
    # step j covers samples 4j..4j+3: rank 0 takes the first two, rank 1 the other two, so the
    # ranks never share a sample (compared by position: windows may repeat across epochs)
    for j in range(4):
        assert batches0[j] == samples0[4 * j:4 * j + 2]
        assert batches1[j] == samples0[4 * j + 2:4 * j + 4]


def test_sequences_per_pass_count_one_pass_over_the_split(twelve_docs, tiny_model, tiny_tokenizer):
    """megatron-core repeats a split until it has the samples asked for; one pass over the 6 training
    documents makes (their tokens - 1) // SEQ windows (the extra token is the last label)."""
    from megatron_dmoe.data.datasets import sequences_per_pass

    prefix, docs = twelve_docs
    train, _, _ = build_datasets(_config([prefix], tiny_model), tiny_tokenizer, (500, 10, 10))
    one_pass = (sum(len(doc) for doc in docs[:6]) - 1) // SEQ
    assert sequences_per_pass(train) == one_pass
    assert len(train) >= 500 > one_pass  # the passes repeat it
    assert sequences_per_pass(object()) is None
