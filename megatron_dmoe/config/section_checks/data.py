"""data.*: the tokenizer type and the files it needs, the data paths and the split (the files
themselves are read where the data is built)."""
from __future__ import annotations

import math
from typing import List, Optional

from .. import tokenizer_types as tokenizers
from .state import CheckState


def _check_tokenizer(state: CheckState) -> None:
    """Megatron-LM's tokenizer types and the files each needs (config/tokenizer_types.py); the files
    themselves are read where the data is built."""
    v, ok, key = state.v, state.ok, "data.tokenizer_type"
    if not ok(key, "data.data_path") or v(key) is None:
        return
    kind = v(key)
    if not v("data.data_path"):
        # a run imported without data (dmoe-import) meets this when it is first trained
        model = v("data.tokenizer_model") if ok("data.tokenizer_model") else None
        how = f" (tools/preprocess_data.py --tokenizer-type {kind} --tokenizer-model {model})" if model else ""
        state.problem(key, f"{kind} names the tokenizer of your data, but data.data_path is empty (the "
                      f"built-in corpus has its own tokenizer); set data.data_path=PREFIX to data tokenized "
                      f"with it{how}, or unset {key}")
        return
    missing = [f"data.{name} ({tokenizers.FLAGS[name]})" for name in tokenizers.REQUIRED_KEYS[kind]
               if ok(f"data.{name}") and v(f"data.{name}") in (None, "")]
    if missing:
        state.problem(key, f"{kind} needs {' and '.join(missing)}")
    module = tokenizers.missing_module(kind)
    if module:
        state.problem(key, f"{kind} needs the Python package {module}")
    for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
        if name not in tokenizers.REQUIRED_KEYS[kind] and ok(f"data.{name}") and v(f"data.{name}") is not None:
            state.warn(f"data.{name}", f"is not used by {key} {kind} (it reads "
                       f"{', '.join('data.' + n for n in tokenizers.REQUIRED_KEYS[kind])})")


def check(state: CheckState) -> None:
    _check_tokenizer(state)
    if state.ok("data.data_path"):
        message = _data_path_problem(state.v("data.data_path"))
        if message:
            state.problem("data.data_path", message)
    if state.ok("data.split"):
        message = _split_problem(state.v("data.split"))
        if message:
            state.problem("data.split", message)
    if state.ok("data.valid_data_path", "data.data_path") and state.v("data.valid_data_path"):
        message = _data_path_problem(state.v("data.valid_data_path"))
        if message:
            state.problem("data.valid_data_path", message)
        elif not state.v("data.data_path"):
            state.problem("data.valid_data_path", "is set but data.data_path is empty: separate "
                          "validation data needs training data of the same tokenizer; set "
                          "data.data_path, or leave both unset for the built-in corpus")


def _as_number(text: str) -> Optional[float]:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _data_path_problem(items: List[str]) -> Optional[str]:
    shape = "use [prefix] or [weight, prefix, weight, prefix, ...]"
    if len(items) <= 1:
        if items and not items[0].strip():
            return f"the prefix is empty; {shape}"
        return None
    if len(items) % 2:
        return f"{len(items)} items, but weights and prefixes come in pairs; {shape}"
    for i in range(0, len(items), 2):
        weight, prefix = items[i], items[i + 1]
        number = _as_number(weight)
        if number is None:
            return f"item {i + 1} ({weight!r}) should be a weight (a number); {shape}"
        if number <= 0:
            return f"weight {weight} (item {i + 1}) must be positive; {shape}"
        if not prefix.strip() or _as_number(prefix) is not None:
            return f"item {i + 2} ({prefix!r}) should be a path prefix; {shape}"
    return None


def _split_problem(text: str) -> Optional[str]:
    shape = "use three non-negative numbers 'train,valid,test' such as '969,30,1'"
    parts = text.split(",")
    numbers = [_as_number(p.strip()) for p in parts]
    if len(parts) != 3 or any(n is None for n in numbers):
        return f"{text!r} is not three numbers; {shape}"
    if any(n < 0 for n in numbers):
        return f"{text!r} has a negative part; {shape}"
    if sum(numbers) <= 0:
        return f"{text!r} sums to 0; {shape}"
    return None
