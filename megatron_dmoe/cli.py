"""Command-line entry points."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

TRAIN_DESCRIPTION = """\
Train a dropless-MoE GPT from a YAML config.

CONFIG is a YAML file, or the name of a shipped config (e.g. `tiny`, `zoo/dmoe_small`); without
it the built-in default run (configs/tiny.yaml) trains on a corpus made from the Python standard
library, prepared and cached on first use. Any number of `section.key=value` overrides follow,
e.g. `moe.top_k=2 training.train_iters=50`. The config is validated before anything is built;
every problem is reported with its key. On GPUs the estimated peak memory per GPU is printed at
start, and a run estimated not to fit is refused before its model is built; on a CPU, a run whose
processes would need more than the machine's available memory (`training.memory_check=false` runs
either anyway).

With --nproc-per-node N it starts N training processes through torchrun's launcher
(`dmoe-train --nproc-per-node 2 CONFIG ...`), after checking the configuration once; a process that
fails is one line with its exit code.

Megatron-LM's pretrain_gpt.py flags are taken too (the README's "Megatron-LM flags" lists them):
one with a key sets it (`--micro-batch-size 4` is training.micro_batch_size=4), those that select a
fusion or an implementation replaced here are ignored with one note, and the rest are refused, one
line each, naming what to use.

Also runs as `python -m megatron_dmoe`, and as each worker of a plain torchrun
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
        "CONFIG the run directory's own config.yaml is used; a config that differs in a key the "
        "checkpoint depends on is refused before anything is written; with no checkpoint yet, a "
        "new run starts at step 0 (and says so)",
    )
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        metavar="DIR",
        help="Megatron-LM's checkpoint directory: here the run directory (the same as --run-dir DIR; "
        "its checkpoints go into DIR/checkpoints). With --load DIR naming the same directory the run "
        "continues from its newest checkpoint there, as --resume (a new run when it has none)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a --run-dir that holds a previous run's files (config.yaml, "
        "metrics.jsonl, checkpoints/, ...): they are deleted once the new run is built. Without "
        "--overwrite or --resume such a directory is refused",
    )
    from megatron_dmoe.launcher import add_launch_arguments

    add_launch_arguments(parser)
    return parser


def _split_args(args: List[str]):
    from megatron_dmoe.config.load import looks_like_key

    config = None
    overrides = []
    for i, arg in enumerate(args):
        # An existing file is the config even when its path holds '=' (dmoe-sweep's run
        # directories are named top_k=1,lr=0.001,...).
        if i == 0 and Path(os.path.expanduser(arg)).is_file():
            config = arg
        elif "=" in arg or i > 0 or looks_like_key(arg):  # `training.train_iters`: an override without its value
            overrides.append(arg)  # a malformed one is reported with every other problem
        else:
            config = arg
    return config, overrides


def _megatron_flags(parser: argparse.ArgumentParser, argv: List[str]):
    """Megatron-LM's flags that have a config key, as overrides (`--micro-batch-size 4` is
    training.micro_batch_size=4; each is reported once), the flags with no effect here in one note; a
    refused or unknown flag is an error line of its own naming what to type."""
    from megatron_dmoe.config.megatron_names import flags_to_overrides

    own = [flag for action in parser._actions for flag in action.option_strings]
    rest, overrides, problems, ignored = flags_to_overrides(argv, own)
    if problems:  # one line each, after the usage, as argparse tells one
        parser.print_usage(sys.stderr)
        for problem in problems:
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        sys.exit(2)
    for override in overrides:
        print(f"{parser.prog}: note: Megatron-LM flag read as {override}", file=sys.stderr)
    if ignored:
        print(f"{parser.prog}: note: Megatron-LM flags with no effect here (they select fusions or "
              f"implementations this package replaces; README: Megatron-LM flags): {' '.join(ignored)}",
              file=sys.stderr)
    return rest, overrides


def _fail(message: str) -> int:
    print(f"dmoe-train: error: {message}", file=sys.stderr)
    return 2


def _fail_once(message: str) -> int:
    """A problem every rank finds alike (config, run directory), before the process group exists:
    under torchrun only rank 0 tells it. The other ranks wait a moment before they exit: torchrun
    stops every rank as soon as one fails, which on a busy machine took rank 0 down before it had
    told anything."""
    if os.environ.get("RANK", "0") == "0":
        return _fail(message)
    time.sleep(_QUIET_RANK_EXIT_DELAY_S)
    return 2


_QUIET_RANK_EXIT_DELAY_S = 5.0  # rank 0 exits sooner, and torchrun then stops the waiting ranks at once


def _check_run_dir(ns, cfg) -> Optional[str]:
    """Why the run directory cannot take this run (None when it can); reads, never writes."""
    from megatron_dmoe.config import load_config, resolve
    from megatron_dmoe.training.run_dir import (
        CONFIG_FILE,
        has_checkpoints,
        mismatch_message,
        previous_run_files,
        resume_mismatches,
    )

    run_dir = ns.run_dir
    if run_dir is None:
        return None
    if not ns.resume:
        files = previous_run_files(run_dir)
        if files and not ns.overwrite:
            what = "checkpoints" if has_checkpoints(run_dir) else "a previous run's files"
            return (f"{run_dir} already holds {what} ({', '.join(files)}); pass --resume to continue "
                    "that run, --overwrite to replace it, or choose another --run-dir")
        return None
    saved_path = run_dir / CONFIG_FILE
    if not has_checkpoints(run_dir) or not saved_path.is_file():
        return None
    from megatron_dmoe.training.checkpoint import checkpoint_dir, latest_iteration
    from megatron_dmoe.training.checkpoint_damage import damage_message
    from megatron_dmoe.training.run_dir import checkpoint_root
    from megatron_dmoe.training.stops import resume_command

    root = checkpoint_root(run_dir)
    damage = damage_message(checkpoint_dir(root, latest_iteration(root)), resume_command(run_dir))
    if damage:
        return damage
    saved = resolve(load_config(str(saved_path)))
    mismatches = resume_mismatches(saved, cfg)
    return mismatch_message(run_dir, mismatches) if mismatches else None


def _load_and_validate(config_name: Optional[str], overrides: List[str], world_size: int):
    """The resolved config; one ConfigError with every problem: the keys and overrides that
    could not be read together with what validation finds in the rest."""
    from megatron_dmoe.config import ConfigError, find_problems, resolve
    from megatron_dmoe.config.cpu_fallback import cpu_precision_fallback
    from megatron_dmoe.config.environment import cuda_available
    from megatron_dmoe.config.load import load_config_partly

    cfg, problems = load_config_partly(config_name, overrides)
    cfg = resolve(cfg)
    if problems:
        reported = {key for key, _ in problems}
        checked, _ = cpu_precision_fallback(cfg, cuda_available())
        problems += [p for p in find_problems(checked, world_size=world_size)
                     if p[0] not in reported]
        raise ConfigError(problems)
    return cfg


def _saved_layout_hint(ns, config_name, overrides, cfg, err, world_size: int) -> Optional[str]:
    """A resume refused only because the run's saved parallel layout needs other processes: the
    line naming its config.yaml, the keys and the commands that work (None otherwise)."""
    from megatron_dmoe.training.layout_hint import saved_layout_message
    from megatron_dmoe.training.run_dir import CONFIG_FILE

    if not ns.resume or cfg is None or config_name != str(ns.run_dir / CONFIG_FILE):
        return None
    return saved_layout_message(ns.run_dir, ns.run_dir / CONFIG_FILE, cfg, [key for key, _ in err.problems],
                                overrides, world_size)


def _load_of_this_run(parser: argparse.ArgumentParser, ns, overrides: List[str]) -> List[str]:
    """Megatron-LM's `--save DIR --load DIR`: a --load (checkpoint.load) naming the run directory
    itself, or its checkpoints/ folder, continues the run there (--resume); the overrides without it."""
    from megatron_dmoe.training.run_dir import CHECKPOINTS

    loads = [o for o in overrides if o.startswith("checkpoint.load=")]
    if not loads or ns.run_dir is None:
        return overrides
    target = Path(os.path.expanduser(loads[-1].partition("=")[2])).resolve()
    if target not in (ns.run_dir.resolve(), (ns.run_dir / CHECKPOINTS).resolve()):
        return overrides
    if "checkpoint.finetune=true" in overrides:
        parser.error(f"--finetune with --load {target} naming this run's own directory would start it over "
                     "on its own checkpoints; fine-tune into a new --save/--run-dir with --load naming the "
                     "run to start from")
    if not ns.overwrite:
        ns.resume = True
        print(f"{parser.prog}: note: --load names the run directory: continuing the run there (--resume; a new "
              "run when it holds no checkpoint)", file=sys.stderr)
    return [o for o in overrides if not o.startswith("checkpoint.load=")]


def parse_train_args(argv: Optional[List[str]]):
    """dmoe-train's command line -> (namespace, config name or None, overrides); exits on misuse."""
    parser = _train_parser()
    # intermixed: overrides may also follow the flags (`--run-dir R --resume key=value`); Megatron-LM's
    # flags that name one of our keys become overrides
    argv, megatron_overrides = _megatron_flags(parser, sys.argv[1:] if argv is None else list(argv))
    ns = parser.parse_intermixed_args(argv)
    config_name, overrides = _split_args(ns.args + megatron_overrides)
    if ns.save is not None:
        if ns.run_dir is not None and ns.run_dir.resolve() != ns.save.resolve():
            parser.error(f"--save {ns.save} and --run-dir {ns.run_dir} name two directories: a run writes "
                         "into one (its checkpoints into DIR/checkpoints); pass one of them")
        ns.run_dir = ns.save
    overrides = _load_of_this_run(parser, ns, overrides)
    if ns.resume and ns.run_dir is None:
        parser.error("--resume needs --run-dir, the directory of the run to continue")
    if ns.overwrite and ns.run_dir is None:
        parser.error("--overwrite needs --run-dir, the directory whose previous run it replaces")
    if ns.resume and ns.overwrite:
        parser.error("--resume continues the run in --run-dir and --overwrite replaces it: pass one")
    from megatron_dmoe.launcher import launch_problem

    problem = launch_problem(ns)
    if problem:
        parser.error(problem)
    return ns, config_name, overrides


def _checked_run(ns, config_name: Optional[str], overrides: List[str], world_size: int, launching: bool):
    """(cfg, notices) of a run that may start, or the exit code after its one line: the config, the
    run directory, the data (with several processes) and where the run directory is made. Reads only:
    a refused run leaves the run directory as it was."""
    from megatron_dmoe.config import ConfigError, validate
    from megatron_dmoe.config.cpu_fallback import cpu_precision_fallback
    from megatron_dmoe.config.environment import cuda_available
    from megatron_dmoe.training.checkpoint import CheckpointError
    from megatron_dmoe.training.run_dir import (
        has_checkpoints,
        resume_notes,
        unstarted_run_note,
        unwritable_run_dir,
    )

    cfg = None
    try:
        cfg = _load_and_validate(config_name, overrides, world_size)
        cfg, notices = cpu_precision_fallback(cfg, cuda_available())
        validate(cfg, world_size=world_size)
    except ConfigError as err:
        return _fail_once(_saved_layout_hint(ns, config_name, overrides, cfg, err, world_size) or str(err))
    if not ns.resume and not ns.overwrite:
        note = unstarted_run_note(ns.run_dir)
        if note:  # a run that stopped before its first step: this one takes its place
            ns.overwrite = True
            notices = [*notices, note]
    try:
        problem = _check_run_dir(ns, cfg)
    except ConfigError as err:
        return _fail_once(f"cannot read the config.yaml of {ns.run_dir} to compare it: {err}")
    except CheckpointError as err:
        return _fail_once(str(err))
    if not problem and cfg.checkpoint.load and not (ns.resume and has_checkpoints(ns.run_dir)):
        from megatron_dmoe.training.load_source import named_checkpoint

        try:  # a --load naming no checkpoint is told before anything is built
            named_checkpoint(cfg.checkpoint.load, "checkpoint.load")
        except CheckpointError as err:
            problem = str(err)
    if problem:
        return _fail_once(problem)
    if ns.resume:
        notices = [*notices, *resume_notes(ns.run_dir, cfg)]
    if world_size > 1 or launching:  # one process: training reports it the same, in order
        from megatron_dmoe.training.data_precheck import data_problem

        problem = data_problem(cfg)
        if problem:
            return _fail_once(problem)
    # the default run directory is made under runs/ (its name needs the process group)
    problem = unwritable_run_dir(ns.run_dir or Path("runs") / "new")
    if problem:
        return _fail_once(problem)
    return cfg, notices


def _worker_args(ns, config_name: Optional[str], overrides: List[str]) -> List[str]:
    """dmoe-train's arguments for the processes the launcher starts (the launch flags left out)."""
    args = [*([config_name] if config_name else []), *overrides]
    if ns.run_dir is not None:
        args += ["--run-dir", str(ns.run_dir)]
    return args + ["--resume"] * ns.resume + ["--overwrite"] * ns.overwrite


def train_main(argv: Optional[List[str]] = None) -> int:
    from megatron_dmoe.console import held_warnings, show_warnings_plainly

    show_warnings_plainly("dmoe-train")
    from megatron_dmoe.data import DataError
    from megatron_dmoe.launcher import launch, world_size
    from megatron_dmoe.training.checkpoint import CheckpointError
    from megatron_dmoe.training.memory_estimate import MemoryCheckError
    from megatron_dmoe.training.run_dir import CONFIG_FILE, RunDirError

    ns, config_name, overrides = parse_train_args(argv)
    launching = ns.nproc_per_node is not None
    worker_args = _worker_args(ns, config_name, overrides)
    if config_name is None and ns.resume and (ns.run_dir / CONFIG_FILE).exists():
        config_name = str(ns.run_dir / CONFIG_FILE)
    processes = world_size(ns) if launching else int(os.environ.get("WORLD_SIZE", 1))
    # the config's warnings once it is known the run starts; under the launcher, its workers tell them
    with held_warnings() as held:
        checked = _checked_run(ns, config_name, overrides, processes, launching)
        held.show = not isinstance(checked, int) and not launching
    if isinstance(checked, int):
        return checked
    if launching:
        return launch(ns, worker_args)
    cfg, notices = checked

    import torch

    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed
    from megatron_dmoe.training.loop import train
    from megatron_dmoe.training.out_of_memory import host_out_of_memory_message, out_of_memory_message
    from megatron_dmoe.training.run_dir import default_run_dir

    par = cfg.parallel
    env = init_distributed(
        cfg.training.device,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.expert_model_parallel_size,
        par.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
    )
    failed = True
    try:
        run_dir = ns.run_dir or default_run_dir(config_name or "tiny")
        result = train(cfg, env, run_dir, resume=ns.resume, overwrite=ns.overwrite, notices=notices)
        failed = False
    except (DataError, CheckpointError, RunDirError, MemoryCheckError) as err:
        return _fail(str(err)) if str(err) else 2  # no text: another rank tells why
    except torch.OutOfMemoryError as err:
        return _fail(out_of_memory_message(err, cfg))
    except (RuntimeError, MemoryError) as err:
        message = host_out_of_memory_message(err, cfg, env.world_size)
        if message is None:
            raise
        return _fail(message)
    except KeyboardInterrupt:
        # The second Ctrl-C: stop at once; an unfinished save never becomes `latest`.
        from megatron_dmoe.training.stops import resume_command

        if env.is_main:
            print("dmoe-train: interrupted without saving; the newest complete checkpoint (if any) is kept; "
                  f"continue with: {resume_command(ns.run_dir or 'RUN_DIR')}", file=sys.stderr)
        return 130
    finally:
        # after a failure the other ranks may never arrive: abort instead of waiting for them
        destroy_distributed(abort=failed)
    if env.is_main:
        summary = f"run directory: {result.run_dir} (step {result.iteration}"
        if result.val_loss is not None:
            summary += f", validation loss {result.val_loss:.4f}"
            if result.val_step != result.iteration:  # stopped by a signal between evaluations
                summary += f" at step {result.val_step}"
        print(summary + ")")
    return 130 if result.stop_signal == "SIGINT" else 0


def main() -> None:
    sys.exit(train_main())


SWEEP_DESCRIPTION = """\
Run a config sweep, submit it to SLURM as one job array, or summarise its runs.

A sweep file names a base config and the values to vary:

  base: tiny                         # config file (relative to the sweep file) or shipped name
  overrides: {training.train_iters: 500}          # every run
  grid: {moe.top_k: [1, 2]}                       # all combinations
  zip: {training.lr: [1.0e-3, 2.0e-3], training.min_lr: [1.0e-4, 2.0e-4]}  # walked together
  slurm: {partition: gpu, time: "04:00:00"}       # sbatch options for --slurm

`key=value` items after SWEEP.yaml are set in every run, over the file's own overrides
(`dmoe-sweep sweep.yaml training.train_iters=50`).

Each run gets a directory under --runs-dir named after its values (e.g. top_k=2,lr=0.002,...)
with its resolved config.yaml, written before anything runs. Every run's config is validated
first; a mistake stops the sweep before anything is written or submitted. Runs train with
`dmoe-train --run-dir DIR --resume`, so a sweep started again continues where it stopped. Local
runs train one after another, or with --concurrent N up to N at once, each on GPUs of its own.
"""


def _sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmoe-sweep",
        description=SWEEP_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sweep", nargs="?", type=Path, metavar="SWEEP.yaml",
                        help="the sweep file (see above)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="set in every run, over the sweep file's overrides (a key the sweep "
                        "varies is refused), e.g. training.train_iters=50")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the sweep and list its runs (name, run directory, overrides) "
                        "without writing or running anything")
    parser.add_argument("--slurm", action="store_true",
                        help="write the run directories and submit ONE SLURM job array whose task "
                        "i trains run i (scripts/slurm/train.sbatch: requeued and resumed when "
                        "preempted); configs are checked as for GPU nodes")
    parser.add_argument("--runs-dir", type=Path, default=None, metavar="DIR",
                        help="folder of the sweep's run directories (default: runs/<sweep file "
                        "name>)")
    parser.add_argument("--summary", type=Path, default=None, metavar="DIR",
                        help="instead of running a sweep, print a table of the runs in DIR: "
                        "steps, final training and validation loss, mean tokens/s")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE",
                        help="draw the runs' loss curves together into this PNG (with --summary, "
                        "or after a local sweep)")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="local runs: train each run with N processes under torchrun "
                        "(default 1)")
    parser.add_argument("--concurrent", type=int, default=None, metavar="N",
                        help="local runs: train up to N runs at the same time, each on GPUs of "
                        "its own (run slot s gets devices s*P ... s*P+P-1 with P = "
                        "--nproc-per-node, through CUDA_VISIBLE_DEVICES, counted within the "
                        "sweep's own CUDA_VISIBLE_DEVICES when set); N x P must not exceed the "
                        "GPUs. A run that ends frees its slot for the next one. Each output line "
                        "on the terminal starts with [run name]; RUN_DIR/train.log holds the "
                        "run's own lines. Without GPUs the runs share the CPU. Default 1: one "
                        "after another")
    parser.add_argument("--sbatch-script", type=Path, default=None, metavar="PATH",
                        help="with --slurm: the batch script of each array task (default: this "
                        "repository's scripts/slurm/train.sbatch)")
    return parser


def sweep_main(argv: Optional[List[str]] = None) -> int:
    from megatron_dmoe.console import show_warnings_plainly
    from megatron_dmoe.sweep import SweepError
    from megatron_dmoe.sweep.commands import run_sweep, summarize
    from megatron_dmoe.sweep.slurm import SubmitError

    show_warnings_plainly("dmoe-sweep")
    parser = _sweep_parser()
    ns = parser.parse_intermixed_args(argv)
    if (ns.sweep is None) == (ns.summary is None):
        parser.error("give a SWEEP.yaml to run, or --summary DIR to summarise runs (not both)")
    if ns.summary is not None and (ns.dry_run or ns.slurm or ns.runs_dir or ns.overrides
                                   or ns.concurrent is not None):
        parser.error("--summary takes only --plot")
    if ns.plot is not None and (ns.dry_run or ns.slurm):
        parser.error("--plot needs finished runs: after the sweep, use --summary DIR --plot FILE")
    if ns.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {ns.nproc_per_node}")
    if ns.concurrent is not None and ns.concurrent < 1:
        parser.error(f"--concurrent must be at least 1 (runs trained at once), got {ns.concurrent}")
    if ns.concurrent is not None and ns.slurm:
        parser.error("--concurrent is for local runs: a SLURM job array already runs its tasks "
                     "at the same time; leave --concurrent out with --slurm")
    try:
        if ns.summary is not None:
            return summarize(ns.summary, ns.plot)
        return run_sweep(ns.sweep, ns.runs_dir, dry_run=ns.dry_run, slurm=ns.slurm, plot=ns.plot,
                         nproc_per_node=ns.nproc_per_node, sbatch_script=ns.sbatch_script,
                         concurrent=ns.concurrent or 1, overrides=ns.overrides)
    except (SweepError, SubmitError, FileNotFoundError, ValueError) as err:
        print(f"dmoe-sweep: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        from megatron_dmoe.training.write_errors import write_failure

        reason = write_failure(err)
        if reason is None:
            raise
        print(f"dmoe-sweep: error: cannot write {err.filename}: {reason}; make it writable or choose "
              "another --runs-dir", file=sys.stderr)
        return 2
