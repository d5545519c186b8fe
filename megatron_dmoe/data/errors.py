"""The one exception type for problems with data files, tokenizers and corpus settings."""


class DataError(Exception):
    """A data file, tokenizer or data setting a user can fix; the message says which and how."""
