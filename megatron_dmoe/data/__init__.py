"""Data: sentencepiece tokenizer, preprocessing into indexed datasets, the built-in corpus,
megatron-core GPT datasets with blending and splits, and a resumable micro-batch loader."""
from megatron_dmoe.data.builtin import prepare_builtin_corpus
from megatron_dmoe.data.checks import check_data_files, check_tokenizer_matches
from megatron_dmoe.data.datasets import build_datasets, build_tokenizer, parse_blend
from megatron_dmoe.data.errors import DataError, DataWarning
from megatron_dmoe.data.loader import build_loader
from megatron_dmoe.data.preprocess import preprocess_data
from megatron_dmoe.data.sentencepiece_tokenizer import SentencePieceTokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "DataError",
    "DataWarning",
    "SentencePieceTokenizer",
    "build_datasets",
    "build_loader",
    "build_tokenizer",
    "check_data_files",
    "check_tokenizer_matches",
    "load_tokenizer",
    "parse_blend",
    "prepare_builtin_corpus",
    "preprocess_data",
    "train_tokenizer",
]
