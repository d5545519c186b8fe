"""The one exception type for problems with data files, tokenizers and corpus settings, and the
warning for data settings that work but are likely not meant."""


class DataError(Exception):
    """A data file, tokenizer or data setting a user can fix; the message says which and how."""


class DataWarning(UserWarning):
    """A data setting that works but is likely not meant (e.g. a split left without documents
    that training never reads)."""
