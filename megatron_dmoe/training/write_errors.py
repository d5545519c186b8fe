"""Tell a checkpoint write that failed for space or permissions from any other failure.

The error that reaches the saving rank is often wrapped (torch's CheckpointException, megatron's
"Worker failure") or pickled into text, and torch's zip writer reports a full disk only as
"[enforce fail at inline_container.cc:...] unexpected pos ...": the whole chain is searched.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator, Optional

# errno values of a write refused for space or for permissions
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}
# torch's zip writer reports a short write (a full disk) only as text, e.g.
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
_SHORT_WRITE = ("inline_container", "unexpected pos", "file write failed")


def causes(err: BaseException) -> Iterator[BaseException]:
    """The error, its causes and contexts, and the per-rank failures torch's CheckpointException
    collects (as exceptions or (exception, traceback) pairs)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _errno(e: BaseException) -> Optional[int]:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    # Worker errors reach this rank pickled into text, e.g. "Worker failure: [Errno 28] No space ..."
    match = re.search(r"\[Errno (\d+)\]", str(e))
    return int(match.group(1)) if match else None


def write_failure(err: BaseException) -> Optional[str]:
    """What went wrong when a save failed for space or permissions; None for anything else."""
    for e in causes(err):
        code = _errno(e)
        if code in _NO_SPACE:
            return "no space left on the device"
        if code in _NO_PERMISSION:
            return f"no permission to write ({os.strerror(code)})"
    for e in causes(err):
        if any(t in str(e) for t in _SHORT_WRITE):
            return "a file could not be written in full, as on a full device"
    return None


def free_space(path: Path) -> str:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown space"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"
