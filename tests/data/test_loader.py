"""The micro-batch loader: Megatron's sample order over data-parallel ranks, exact resumption,
epochs past the end, and workers that change nothing."""
import pytest
import torch

from megatron_dmoe.config.schema import RunConfig
from megatron_dmoe.data.datasets import build_datasets
from megatron_dmoe.data.loader import build_loader


class Indexed(torch.utils.data.Dataset):
    """Sample i holds the number i everywhere, so batches show which samples they carry."""

    def __init__(self, size, seq=4):
        self.size, self.seq = size, seq

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"tokens": torch.full((self.seq,), i), "labels": torch.full((self.seq,), i + 1),
                "loss_mask": torch.ones(self.seq), "position_ids": torch.arange(self.seq),
                "extra": "left out of batches"}


def _ids(batch):
    return batch["tokens"][:, 0].tolist()


def _take(loader, steps):
    return [next(loader) for _ in range(steps)]


def test_ranks_take_contiguous_shares_of_each_step():
    mbs, dp, steps = 3, 2, 5
    per_rank = [[_ids(b) for b in _take(build_loader(Indexed(1000), mbs, 0, r, dp, 0, 1), steps)]
                for r in range(dp)]
    for j in range(steps):
        first = j * mbs * dp
        assert per_rank[0][j] == list(range(first, first + mbs))
        assert per_rank[1][j] == list(range(first + mbs, first + 2 * mbs))


@pytest.mark.parametrize("dp_rank, dp_size", [(0, 1), (1, 3)])
def test_resume_replays_the_uninterrupted_run(dp_rank, dp_size):
    data, mbs, k = Indexed(50), 4, 7  # 7 steps: past the first epoch of 50 samples
    whole = _take(build_loader(data, mbs, 0, dp_rank, dp_size, 0, seed=5), 20)
    resumed = _take(build_loader(data, mbs, k * mbs * dp_size, dp_rank, dp_size, 0, seed=5), 13)
    for a, b in zip(whole[k:], resumed):
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_epochs_past_the_end_are_fresh_permutations():
    size, mbs = 10, 5
    seen = [i for b in _take(build_loader(Indexed(size), mbs, 0, 0, 1, 0, seed=3), 8)
            for i in _ids(b)]
    epochs = [seen[e * size:(e + 1) * size] for e in range(4)]
    assert epochs[0] == list(range(size)), "the first epoch keeps the dataset's order"
    for epoch in epochs[1:]:
        assert sorted(epoch) == list(range(size))
    assert len({tuple(e) for e in epochs}) == 4, "each epoch is shuffled anew"
    other = [i for b in _take(build_loader(Indexed(size), mbs, 0, 0, 1, 0, seed=4), 8)
             for i in _ids(b)]
    assert other[:size] == seen[:size] and other[size:] != seen[size:], "the seed drives epochs"


def test_batches_of_a_gpt_dataset(tmp_path, tiny_model, tiny_tokenizer, write_dataset,
                                  numbered_docs, rng):
    docs = numbered_docs(4, [rng.randint(5, 30) for _ in range(12)], tiny_tokenizer.eod)
    cfg = RunConfig()
    cfg.model.seq_length = 8
    cfg.data.data_path = [write_dataset(tmp_path / "d_text_document", docs)]
    cfg.data.tokenizer_model = tiny_model
    cfg.data.split = "10,1,1"
    train, _, _ = build_datasets(cfg, tiny_tokenizer, (40, 4, 4))
    plain = _take(build_loader(train, 4, 0, 0, 1, num_workers=0, seed=1), 12)
    with_workers = _take(build_loader(train, 4, 0, 0, 1, num_workers=2, seed=1), 12)
    resumed = _take(build_loader(train, 4, 20, 0, 1, num_workers=2, seed=1), 7)
    for j, batch in enumerate(plain):
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert batch["tokens"].shape == batch["labels"].shape == (4, 8)
        assert batch["tokens"].dtype == batch["position_ids"].dtype == torch.long
        assert batch["loss_mask"].dtype == torch.float32
        if 4 * j + 4 <= len(train):  # first epoch: the dataset's samples in order
            expected = torch.stack([train[4 * j + r]["tokens"] for r in range(4)])
            assert torch.equal(batch["tokens"], expected)
        assert all(torch.equal(batch[k], with_workers[j][k]) for k in batch)
    for a, b in zip(plain[5:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_rank"):
        build_loader(Indexed(10), 2, 0, 2, 2, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        build_loader(Indexed(10), 0, 0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="empty"):
        build_loader(Indexed(0), 2, 0, 0, 1, 0, 1)
