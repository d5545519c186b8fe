"""dmoe-eval: loss and perplexity of a trained run."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.inference.cli_common import (
    add_run_arguments,
    distributed_session,
    fail,
    positive_int,
    unwritable_output,
    write_failure_message,
)

PROG = "dmoe-eval"
DESCRIPTION = """\
Loss and perplexity of a trained run's checkpoint, as JSON on stdout (and in --out FILE).

Without --data-path the run's own validation split is read exactly as training read it, so the loss
equals the val_loss that metrics.jsonl logged for that checkpoint's step. With --data-path, every
document of the given indexed datasets (tools/preprocess_data.py output, made with the run's
tokenizer) is read once in sequences of the run's length.

Runs on a CPU or GPUs; under torchrun the batches are spread over the processes, and
--expert-parallel N spreads the experts over N of them:
  torchrun --nproc_per_node 2 -m megatron_dmoe.inference.eval_cli RUN_DIR --expert-parallel 2
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                        help="indexed dataset prefixes (PREFIX.bin / PREFIX.idx) to evaluate on instead of "
                        "the run's validation split")
    parser.add_argument("--micro-batch-size", type=positive_int, default=None, metavar="N",
                        help="sequences per forward pass (default: the run's training.micro_batch_size)")
    parser.add_argument("--expert-parallel", type=positive_int, default=1, metavar="N",
                        help="expert-parallel size under torchrun (must divide the number of processes; "
                        "default 1)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the JSON result to FILE")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr (there is none when stderr is not a terminal)")
    return parser


def eval_main(argv: Optional[List[str]] = None) -> int:
    ns = _parser().parse_args(argv)
    from megatron_dmoe.console import show_warnings_plainly

    show_warnings_plainly(PROG)
    from megatron_dmoe.inference.errors import UsageError
    from megatron_dmoe.inference.evaluate import check_data_path, evaluate_run
    from megatron_dmoe.inference.run_model import find_checkpoint, load_run, read_run_config

    try:
        read_run_config(ns.run_dir)
        find_checkpoint(ns.run_dir, ns.checkpoint)
        if ns.data_path:
            check_data_path(ns.data_path)
        if ns.out is not None:
            if ns.out.is_dir():
                raise UsageError(f"--out {ns.out} is a directory; name the file to write the result to")
            problem = unwritable_output(ns.out, "--out")
            if problem:
                raise UsageError(problem)
        with distributed_session():
            run = load_run(ns.run_dir, device=ns.device, checkpoint=ns.checkpoint,
                           expert_parallel=ns.expert_parallel, with_data=ns.data_path is None)
            if ns.micro_batch_size:
                run.cfg.training.micro_batch_size = ns.micro_batch_size
            result = {"run_dir": str(ns.run_dir), **evaluate_run(run, ns.data_path, progress=not ns.no_progress)}
            is_main = run.env.is_main
    except UsageError as err:
        return fail(PROG, str(err))
    if is_main:
        text = json.dumps(result, indent=2)
        print(text)
        if ns.out is not None:
            try:
                ns.out.parent.mkdir(parents=True, exist_ok=True)
                ns.out.write_text(text + "\n")
            except OSError as err:  # a full disk: the result above is still printed
                message = write_failure_message(err, ns.out, "--out")
                if message is None:
                    raise
                with contextlib.suppress(OSError):
                    ns.out.unlink(missing_ok=True)  # a cut-off result is no result
                return fail(PROG, message)
    return 0


def main() -> None:
    sys.exit(eval_main())


if __name__ == "__main__":
    main()
