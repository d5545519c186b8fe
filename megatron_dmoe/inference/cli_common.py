"""What dmoe-eval, dmoe-generate and dmoe-export share: arguments, error reporting, teardown."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path


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
