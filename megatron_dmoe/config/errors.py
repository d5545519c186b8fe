"""The one exception a user's configuration mistakes raise, and the warning for settings that run
but probably not as meant."""
from __future__ import annotations

from typing import Iterable, List, Tuple

Problem = Tuple[str, str]  # (dotted key or file, what is wrong and what is allowed)


class ConfigError(ValueError):
    """Every problem found in a configuration, each with the key (or file) it concerns.

    ``problems`` is a list of ``(key, message)``; ``str(error)`` lists them one per line so that a
    user sees all mistakes at once instead of fixing them one run at a time.
    """

    def __init__(self, problems: Iterable[Problem]):
        self.problems: List[Problem] = list(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [f"{key}: {message}" for key, message in self.problems]
        if len(lines) == 1:
            return "invalid configuration: " + lines[0]
        head = f"invalid configuration ({len(lines)} problems):"
        return "\n  ".join([head] + lines)

    def __reduce__(self):  # picklable across processes (ValueError would pass the text only)
        return (type(self), (self.problems,))


class ConfigWarning(UserWarning):
    """A setting that works but is likely a mistake (e.g. a warmup longer than the run)."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}")
