"""What dmoe-eval, dmoe-generate and dmoe-export share: arguments, error reporting, teardown."""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def add_run_arguments(parser: argparse.ArgumentParser, device: bool = True) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a dmoe-train run directory (its config.yaml and checkpoints/)")
    parser.add_argument("--checkpoint", type=int, default=None, metavar="ITER",
                        help="the checkpoint of this iteration (default: the newest complete one)")
    if device:
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                            help="where the model runs (default auto: cuda when torch sees a GPU, else cpu)")


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def unwritable_output(path: Path, option: str) -> Optional[str]:
    """Why `path` (a file or directory to create) cannot be written, naming `option`; None when it
    can. Reads only: checked before any work, so a refused output costs nothing."""
    path = Path(path)
    place = path if path.exists() else path.absolute().parent
    while not place.exists() and place != place.parent:
        place = place.parent  # the folder the missing ones will be created in
    # access() answers for the caller (root included) and reports a read-only mount
    if os.access(place, os.W_OK | (os.X_OK if place.is_dir() else 0)):
        return None
    try:
        read_only = bool(os.statvfs(place).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "a read-only file system" if read_only else "no write permission"
    return f"{option} {path}: cannot write to {place} ({why}); make it writable or choose another {option}"


def write_failure_message(err: OSError, path: Path, option: str) -> Optional[str]:
    """One line for an output write that failed for space or permissions (None for other errors)."""
    from megatron_dmoe.training.write_errors import free_space, write_failure

    reason = write_failure(err)
    if reason is None:
        return None
    return (f"cannot write {option} {path}: {reason} ({free_space(Path(path).absolute().parent)} free there); "
            f"make room (or fix the permissions) or choose another {option}")


@contextmanager
def distributed_session():
    """Tear down torch.distributed afterwards; abort (no waiting for other ranks) after a failure."""
    failed = True
    try:
        yield
        failed = False
    finally:
        from megatron_dmoe.parallel.distributed import destroy_distributed

        destroy_distributed(abort=failed)
