"""The run's data files and tokenizer checked on every rank before the process group starts.

Training builds its datasets on rank 0 first while the other ranks wait for it; a bad data path
found there ended rank 0 with one line and every other rank with a connection-error traceback (rank
0 had left). Checked here, every rank finds the same problem, and only rank 0 tells it."""
from __future__ import annotations

import os
from typing import Optional

from megatron_dmoe.config import RunConfig


def data_problem(cfg: RunConfig) -> Optional[str]:
    """What is wrong with data.data_path, data.valid_data_path or the tokenizer (the DataError's
    text), None when nothing is found. The built-in corpus is not prepared here (rank 0 does that
    once in training)."""
    if not cfg.data.data_path:
        return None
    from megatron_dmoe.data import DataError, build_tokenizer, check_data_files, parse_blend
    from megatron_dmoe.data.datasets import resolve_valid_blend

    try:
        build_tokenizer(cfg)  # the order training checks in: the tokenizer, then the files
        prefixes, _ = parse_blend(cfg.data.data_path)
        check_data_files([os.path.abspath(os.path.expanduser(p)) for p in prefixes])
        valid = resolve_valid_blend(cfg)
        if valid is not None:
            try:
                check_data_files(valid[0])
            except DataError as err:
                raise DataError(str(err).replace("data.data_path", "data.valid_data_path")) from None
    except DataError as err:
        return str(err)
    return None
