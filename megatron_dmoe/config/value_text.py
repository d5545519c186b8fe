"""Values as the user wrote them in YAML, and the allowed range of a number, for problem messages."""
from __future__ import annotations

from typing import Optional, Tuple

# (lowest, highest, lowest allowed?, highest allowed?); None = unbounded
Limits = Tuple[Optional[float], Optional[float], Optional[bool], Optional[bool]]


def fmt(value) -> str:
    """A value as written in YAML (true, null, 0.5, 'softmax')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def range_text(low, high, low_in, high_in, value) -> str:
    """'an integer >= 1', 'a number with 0 <= value < 1': `value` picks integer or number."""
    kind = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a number"
    if high is None:
        return f"{kind} {'>=' if low_in else '>'} {fmt(low)}"
    return f"{kind} with {fmt(low)} {'<=' if low_in else '<'} value {'<=' if high_in else '<'} {fmt(high)}"
