"""The error for bad user input to the after-training commands (one line on stderr, exit 2)."""
from __future__ import annotations


class UsageError(ValueError):
    pass
