"""Replace an attribute for the length of a block, then put back exactly what was there; or wrap a
method once for the rest of the process (`wrapped_once`).

The scoped replacements of megatron-core (and torch) attributes in this package go through here
instead of `unittest.mock`, which is test machinery: `patched` stores the attribute as its owner
holds it (a class's staticmethod stays a staticmethod) and, where the owner only inherited it,
removes the replacement again rather than leaving a copy behind. Not thread-safe, like any patch
of a shared object: the replacement is seen by every thread while the block runs.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

_ABSENT = object()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` inside the block (owner: a module, class or object that has `name`)."""
    getattr(owner, name)  # AttributeError for a name the owner lacks: a patch that would do nothing
    own = vars(owner).get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextlib.contextmanager
def patched_in(owners: Iterable[Any], name: str, value: Any) -> Iterator[None]:
    """`patched` in each of `owners` (the modules that hold the same name), restored in reverse."""
    with contextlib.ExitStack() as stack:
        for owner in owners:
            stack.enter_context(patched(owner, name, value))
        yield


def wrapped_once(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """`owner.name = wrap(original)` for the rest of the process, idempotent: the replacement keeps
    the original's name and `__wrapped__`, and is marked with `wrap`, which a second call finds."""
    original = getattr(owner, name)
    if getattr(original, "_wrapped_by", None) is wrap:
        return
    replacement = functools.wraps(original)(wrap(original))
    replacement._wrapped_by = wrap
    setattr(owner, name, replacement)
