"""Train, valid and test datasets of a run through megatron-core's GPTDataset and blending.

`data.data_path` is Megatron-LM's `--data-path`: one prefix, several prefixes (blended in
proportion to their sizes), or weight/prefix pairs. Empty, it means the built-in corpus, whose
tokenizer `build_tokenizer` then loads. `data.valid_data_path` (Megatron-LM's `--valid-data-path`)
names validation data of its own; then all of `data.data_path` trains and `data.split` is unused.
Files, splits and the tokenizer are checked first so a mistake raises one `DataError` instead of a
megatron-core assertion or a hang.

With torch.distributed initialised, `build_datasets` must be called on every rank: megatron-core
builds on rank 0 first (writing the index cache), waits at a barrier, then the other ranks build
from the cache (on nodes that do not share rank 0's cache, one rank per node writes it:
cache_sharing.py). `is_built_on_rank` says which ranks get a dataset (others receive None).
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_dmoe.compat.blended_dataset_rank import rank_zero_without_distributed
from megatron_dmoe.data.builtin import prepare_builtin_corpus
from megatron_dmoe.data.cache import as_index_cache_writer, default_cache_dir, index_cache_lock
from megatron_dmoe.data.checks import check_data_files, check_splits, check_tokenizer_matches
from megatron_dmoe.data.errors import DataError
from megatron_dmoe.data.megatron_tokenizers import spec_from_data_config
from megatron_dmoe.data.sentencepiece_tokenizer import load_tokenizer

Blend = Tuple[List[str], Optional[List[float]]]


def parse_blend(data_path: Sequence) -> Blend:
    """Prefixes and weights (None: by dataset size) from data.data_path's list."""
    items = [str(x).strip() for x in data_path]
    if not items:
        raise DataError("data.data_path is empty; leave it unset to use the built-in corpus")
    weights = [_number(x) for x in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        prefixes = items[1::2]
        if any(_number(p) is not None for p in prefixes) or any(w < 0 for w in weights) \
                or sum(weights) <= 0:
            raise _blend_error(data_path)
        return prefixes, weights
    if any(_number(x) is not None for x in items):
        raise _blend_error(data_path)
    return items, None


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _blend_error(data_path) -> DataError:
    return DataError(
        f"data.data_path={list(data_path)} is neither a list of dataset prefixes nor "
        "weight/prefix pairs such as [0.3, data/a_text_document, 0.7, data/b_text_document] "
        "(weights non-negative, not all 0)"
    )


def build_tokenizer(cfg):
    """The run's tokenizer: data.tokenizer_type (Megatron-LM's types, data/megatron_tokenizers.py), a
    sentencepiece data.tokenizer_model, or the built-in corpus's own tokenizer."""
    data = cfg.data
    spec = spec_from_data_config(data)
    if spec is not None:
        if not data.data_path:
            setting = "data.tokenizer_type" if data.tokenizer_type else "data.tokenizer_model"
            raise DataError(
                f"{setting} is set but data.data_path is empty: the built-in corpus comes with its own "
                f"tokenizer; set data.data_path to data made with that tokenizer, or unset {setting}"
            )
        return spec.build()
    if data.data_path:
        raise DataError(
            "data.data_path is set but no tokenizer is: give the one the data was made with, e.g. "
            "data.tokenizer_model=TOKENIZER.model (sentencepiece, tools/preprocess_data.py "
            "--tokenizer-model), or data.tokenizer_type with its files as in Megatron-LM "
            "(data.tokenizer_type=GPT2BPETokenizer data.vocab_file=... data.merge_file=...)"
        )
    _, model = prepare_builtin_corpus(data.builtin_vocab_size, data.cache_dir)
    return load_tokenizer(model)


def resolve_blend(cfg) -> Tuple[Blend, str]:
    """The blend of absolute prefixes, and the folder for megatron-core's index cache."""
    data = cfg.data
    if not data.data_path:
        prefix, _ = prepare_builtin_corpus(data.builtin_vocab_size, data.cache_dir)
        return ([prefix], None), os.path.join(os.path.dirname(prefix), "index_cache")
    prefixes, weights = parse_blend(data.data_path)
    prefixes = [os.path.abspath(os.path.expanduser(p)) for p in prefixes]
    data_dir = os.path.dirname(prefixes[0])
    if os.access(data_dir, os.W_OK):
        cache = os.path.join(data_dir, "index_cache")
    else:  # read-only shared data: keep the indices in the user's cache
        base = os.path.expanduser(data.cache_dir) if data.cache_dir else str(default_cache_dir())
        cache = os.path.join(base, "index_cache")
    return (prefixes, weights), cache


def resolve_valid_blend(cfg) -> Optional[Blend]:
    """data.valid_data_path as a blend of absolute prefixes, or None when it is not set."""
    if not cfg.data.valid_data_path:
        return None
    if not cfg.data.data_path:
        raise DataError("data.valid_data_path is set but data.data_path is empty: separate "
                        "validation data needs training data made with the same tokenizer")
    try:
        prefixes, weights = parse_blend(cfg.data.valid_data_path)
    except DataError as err:
        raise DataError(str(err).replace("data.data_path", "data.valid_data_path")) from None
    return [os.path.abspath(os.path.expanduser(p)) for p in prefixes], weights


def build_datasets(
    cfg,
    tokenizer,
    num_samples: Tuple[Optional[int], Optional[int], Optional[int]],
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    writer: Optional[bool] = None,
):
    """(train, valid, test) GPTDatasets (or BlendedDatasets) of `num_samples` samples each.

    `writer`: whether this rank writes the index cache (data/cache_sharing.py's
    `index_cache_writer`, for nodes that do not share it); None: rank 0 only, megatron-core's rule.

    A sample is a window of model.seq_length + 1 tokens as `tokens` and `labels` shifted by one,
    with `loss_mask` and `position_ids`; None for a split whose data.split weight is 0, and for
    test with data.valid_data_path. The shuffling follows training.seed. `num_samples` entries of
    None mean one pass over the split (not allowed with weighted blends).
    """
    if len(num_samples) != 3 or any(n is not None and (int(n) != n or n < 0) for n in num_samples):
        raise ValueError(f"num_samples must be three counts >= 0 (or None), got {num_samples}")
    (prefixes, weights), cache = resolve_blend(cfg)
    if weights is not None and any(n is None for n in num_samples):
        raise ValueError("weighted data.data_path blends need a sample count for every split")
    infos = check_data_files(prefixes)
    valid = resolve_valid_blend(cfg)
    unread_empty = ()
    if valid is None:
        # a split with 0 samples asked (e.g. test, which training never reads) may be empty
        read = [n is None or n > 0 for n in num_samples]
        unread_empty = check_splits(infos, cfg.data.split, read)
        splits = dict(blend=(prefixes, weights), split=cfg.data.split)
    else:
        if valid[1] is not None and num_samples[1] is None:
            raise ValueError("a weighted data.valid_data_path blend needs a validation sample count")
        try:
            check_data_files(valid[0])
        except DataError as err:
            raise DataError(str(err).replace("data.data_path", "data.valid_data_path")) from None
        # megatron-core's per-split blends (Megatron-LM's --train/--valid-data-path): each split
        # draws from all of its own files; there is no test split
        splits = dict(blend_per_split=[(prefixes, weights), valid, None])
        prefixes = prefixes + valid[0]
    check_tokenizer_matches(tokenizer, cfg.model.vocab_size, prefixes)
    config = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        **splits,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if unread_empty:  # not built at all: megatron-core loops forever on a split without tokens
        config.split_matrix = [None if i in unread_empty else m for i, m in enumerate(config.split_matrix)]
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset,
        [None if n is None else int(n) for n in num_samples],
        is_built_on_rank or (lambda: True),
        config,
    )
    if writer is None:
        writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    with rank_zero_without_distributed(), as_index_cache_writer(writer), index_cache_lock(cache, writer):
        train, valid, test = builder.build()
    return train, valid, test


def sequences_per_pass(dataset) -> Optional[int]:
    """How many sequences one pass over `dataset`'s split makes: megatron-core's GPTDataset repeats
    the split (documents shuffled anew each pass) until it has the samples asked for, and len()
    counts every pass. A BlendedDataset: the sum of its parts' (each at most what the blend takes
    from it); None for anything else."""
    if isinstance(dataset, GPTDataset):
        config = dataset.config
        one_pass = (dataset._get_num_tokens_per_epoch() - config.add_extra_token_to_sequence) // config.sequence_length
        return min(one_pass, len(dataset))
    parts = getattr(dataset, "datasets", None)
    if parts is None:
        return None
    counts = [sequences_per_pass(part) for part in parts]
    return None if None in counts else min(sum(counts), len(dataset))
