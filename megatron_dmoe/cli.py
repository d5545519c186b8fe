"""Command-line entry points."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

TRAIN_DESCRIPTION = """\
Train a dropless-MoE GPT from a YAML config.

CONFIG is a YAML file, or the name of a shipped config (e.g. `tiny`, `zoo/dmoe_small`); without
it the built-in default run (configs/tiny.yaml) trains on a corpus made from the Python standard
library, prepared and cached on first use. Any number of `section.key=value` overrides follow,
e.g. `moe.top_k=2 training.train_iters=50`. The config is validated before anything is built;
every problem is reported with its key.

Also runs as `python -m megatron_dmoe` and under torchrun
(`torchrun --nproc_per_node 2 -m megatron_dmoe CONFIG ...`).
"""


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmoe-train",
        description=TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="optional config file or shipped config name, then section.key=value overrides",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="directory for the resolved config.yaml, checkpoints/, metrics.jsonl, tensorboard/ and "
        "plots (default: runs/<config name>-<timestamp>)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --run-dir (same data order and RNG); without a "
        "CONFIG the run directory's own config.yaml is used; with no checkpoint yet, start at step 0",
    )
    return parser


def _split_args(args: List[str]):
    config = None
    overrides = []
    for i, arg in enumerate(args):
        if "=" in arg:
            overrides.append(arg)
        elif i == 0:
            config = arg
        else:
            raise SystemExit(
                f"dmoe-train: unexpected argument {arg!r}: the config comes first, then key=value overrides"
            )
    return config, overrides


def _fail(message: str) -> int:
    print(f"dmoe-train: error: {message}", file=sys.stderr)
    return 2


def _quiet_optional_accelerator_warnings() -> None:
    """megatron-core warns at import that Transformer Engine / apex are absent: both are optional."""
    import warnings

    # ... and its own default cuda_graph_scope trips its own deprecation notice.
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message)


def train_main(argv: Optional[List[str]] = None) -> int:
    _quiet_optional_accelerator_warnings()
    from megatron_dmoe.config import ConfigError, load_config, resolve, validate
    from megatron_dmoe.data import DataError
    from megatron_dmoe.training.checkpoint import CheckpointError
    from megatron_dmoe.training.run_dir import CONFIG_FILE, has_checkpoints

    parser = _train_parser()
    ns = parser.parse_args(argv)
    config_name, overrides = _split_args(ns.args)
    if ns.resume and ns.run_dir is None:
        parser.error("--resume needs --run-dir, the directory of the run to continue")
    if config_name is None and ns.resume and (ns.run_dir / CONFIG_FILE).exists():
        config_name = str(ns.run_dir / CONFIG_FILE)
    try:
        cfg = resolve(load_config(config_name, overrides))
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as err:
        return _fail(str(err))
    if has_checkpoints(ns.run_dir) and not ns.resume:
        return _fail(
            f"{ns.run_dir} already holds checkpoints; pass --resume to continue that run, "
            "or choose another --run-dir"
        )

    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed
    from megatron_dmoe.training.loop import train
    from megatron_dmoe.training.run_dir import default_run_dir

    par = cfg.parallel
    env = init_distributed(
        cfg.training.device,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.expert_model_parallel_size,
    )
    try:
        run_dir = ns.run_dir or default_run_dir(config_name or "tiny")
        result = train(cfg, env, run_dir, resume=ns.resume)
    except (DataError, CheckpointError) as err:
        return _fail(str(err))
    finally:
        destroy_distributed()
    if env.is_main:
        summary = f"run directory: {result.run_dir} (step {result.iteration}"
        if result.val_loss is not None:
            summary += f", validation loss {result.val_loss:.4f}"
        print(summary + ")")
    return 0


def main() -> None:
    sys.exit(train_main())
