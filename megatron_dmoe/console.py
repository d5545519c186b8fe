"""How every dmoe-* command prints warnings: ours (config and data settings that run, but likely not
as meant) as one plain `PROG: warning: ...` line each, like the errors, instead of Python's warning
format with a source line; megatron-core's and torch's that no setting changes left out
(compat/quiet_warnings.py); and, until a command has checked its input, held back, so that a command
then refused prints its error alone."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator


def show_warnings_plainly(prog: str) -> None:
    """Install the plain form for this process, naming `prog` (a later call names its own command).
    Under torchrun only rank 0 shows warnings: the ranks run the same code and would repeat each one."""
    from megatron_dmoe.compat.quiet_warnings import quiet_unactionable_warnings
    from megatron_dmoe.config import ConfigWarning
    from megatron_dmoe.config.environment import cuda_available
    from megatron_dmoe.data.errors import DataWarning

    quiet_unactionable_warnings(cuda_available())
    installed = warnings.showwarning
    if getattr(installed, "plain_user_warnings", False):
        installed.prog = prog  # installed already (another command in this process)
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if os.environ.get("RANK", "0") != "0":
            return  # every rank finds the same: rank 0 tells it
        if issubclass(category, (ConfigWarning, DataWarning)):
            print(f"{show.prog}: warning: {message}", file=file or sys.stderr)
        else:
            installed(message, category, filename, lineno, file, line)

    show.plain_user_warnings = True
    show.prog = prog
    warnings.showwarning = show


class Held:
    show = True  # set False inside the block to drop what it held (a refusal told without an exception)


@contextlib.contextmanager
def held_warnings() -> Iterator[Held]:
    """The warnings raised inside the block are shown when it ends without an exception (unless
    told not to), after the checks in it: a refused command prints its error line without them."""
    held = Held()
    with warnings.catch_warnings(record=True) as caught:
        yield held
    if held.show:
        for w in caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
