"""Megatron-LM's tokenizer types (`data.tokenizer_type`), the files each needs and the packages some
need: what validation checks before any tokenizer is built (they are built in data/megatron_tokenizers.py)."""
from __future__ import annotations

import importlib.util
from typing import Optional

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES, "TikTokenizer",
                   "NullTokenizer")
# what each type needs: data keys (Megatron-LM flags) that must be set
REQUIRED_KEYS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    **{name: ("tokenizer_model",) for name in SENTENCEPIECE_TYPES},
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
# Python packages a type needs beyond this package's own dependencies, and how to get them
EXTRA_MODULES = {
    "GPT2BPETokenizer": ("transformers", "pip install 'megatron-dmoe[tokenizers]' (or transformers)"),
    "HuggingFaceTokenizer": ("transformers", "pip install 'megatron-dmoe[tokenizers]' (or transformers)"),
    "TikTokenizer": ("tiktoken", "pip install 'megatron-dmoe[tiktoken]' (or tiktoken)"),
}
FLAGS = {"tokenizer_model": "--tokenizer-model", "vocab_file": "--vocab-file", "merge_file": "--merge-file",
         "vocab_size": "--vocab-size"}


def missing_module(tokenizer_type: str) -> Optional[str]:
    """'transformers (install with ...)' when the type needs a package that cannot be imported."""
    if tokenizer_type not in EXTRA_MODULES:
        return None
    module, how = EXTRA_MODULES[tokenizer_type]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} ({how})"
