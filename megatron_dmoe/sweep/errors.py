"""The one exception a user's sweep-file mistakes raise."""
from __future__ import annotations

from typing import Iterable, List, Tuple

Problem = Tuple[str, str]  # (where: a sweep key, a run name or a file; what is wrong and what to do)


class SweepError(ValueError):
    """Every problem found in a sweep, each with the place it concerns, reported together.

    ``str(error)`` names the sweep file and lists the problems one per line, so a user fixes them
    all before anything is written or submitted.
    """

    def __init__(self, source: str, problems: Iterable[Problem]):
        self.source = source
        self.problems: List[Problem] = list(problems)
        if not self.problems:
            raise ValueError("SweepError needs at least one problem")
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [f"{where}: {message}" for where, message in self.problems]
        if len(lines) == 1:
            return f"invalid sweep {self.source}: {lines[0]}"
        head = f"invalid sweep {self.source} ({len(lines)} problems):"
        return "\n  ".join([head] + lines)

    def __reduce__(self):
        return (type(self), (self.source, self.problems))
