"""What `dmoe-sweep` does: list, run locally, submit to SLURM, or summarise a sweep.

Everything a user can get wrong in the sweep file is checked before anything is written or
submitted; errors raise SweepError, SubmitError, FileNotFoundError or ValueError with a message
for the user.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, TextIO

from megatron_dmoe.config import Environment

from .gpu_slots import gpu_count, slot_devices
from .local import run_locally
from .points import format_overrides
from .runs import PlannedRun, default_runs_dir, plan_runs, write_runs
from .slurm import SubmitError, default_sbatch_script, find_sbatch, sbatch_command, submit_array
from .spec import SweepSpec, load_sweep, with_overrides
from .status import run_status
from .summary import find_runs, format_table, plot_summary, summarize_run


def run_sweep(sweep_file: os.PathLike, runs_dir: Optional[os.PathLike] = None,
              dry_run: bool = False, slurm: bool = False, plot: Optional[os.PathLike] = None,
              nproc_per_node: int = 1, sbatch_script: Optional[os.PathLike] = None,
              out: Optional[TextIO] = None, concurrent: int = 1,
              device_count: Optional[int] = None, overrides: Sequence[str] = ()) -> int:
    """Returns the exit status: 0, or 1 when a local run failed or did not finish. Output goes
    to ``out`` (default: sys.stdout). ``concurrent``: local runs trained at once, each on GPUs of
    its own out of ``device_count`` (None: the GPUs torch sees); not used with ``slurm``.
    ``overrides``: `section.key=value` items set in every run, over the sweep file's overrides."""
    out = out or sys.stdout
    if not slurm:  # too few GPUs for the concurrent runs: stop before anything is written
        if concurrent > 1 and device_count is None:
            device_count = gpu_count()
        slot_devices(concurrent, nproc_per_node, device_count or 0,
                     os.environ.get("CUDA_VISIBLE_DEVICES"))
    spec = with_overrides(load_sweep(sweep_file), overrides)
    runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir(spec)
    # Runs submitted to SLURM are checked as for GPU nodes, not for the login node.
    env = Environment.everything() if slurm else Environment.detect()
    planned = plan_runs(spec, runs_dir, env)
    if slurm:
        script = _sbatch_script(sbatch_script)
        sbatch = "sbatch" if dry_run else find_sbatch()
    if dry_run:
        print_plan(spec, planned, slurm, out)
        if slurm:
            command = sbatch_command(sbatch, script, len(planned), runs_dir, spec.name, spec.slurm)
            print(f"would submit: RUN_LIST={runs_dir / 'runs.txt'} {' '.join(command)}", file=out)
        return 0
    run_list = write_runs(spec, planned, runs_dir)
    if slurm:
        job = submit_array(run_list, len(planned), spec.name, script, spec.slurm, sbatch)
        print(f"submitted job array {job} with {len(planned)} runs in {runs_dir} (task i trains "
              f"line i+1 of {run_list}); follow it with `squeue -j {job}`, compare the runs with "
              f"`dmoe-sweep --summary {runs_dir}`", file=out)
        return 0
    results = run_locally(planned, nproc_per_node, out, concurrent, device_count)
    rows = [summarize_run(r.run_dir) for r in planned]
    print(format_table(rows), file=out)
    if plot is not None and any(r.train_loss is not None or r.val_loss is not None for r in rows):
        print(f"loss curves: {plot_summary(rows, plot)}", file=out)
    failed = [r.run.point.name for r in results if r.failed]
    unfinished = [r.point.name for r in planned if not run_status(r.run_dir).finished]
    if failed:
        print(f"{len(failed)} of {len(planned)} runs failed: {', '.join(failed)}", file=out)
    if unfinished:
        print(f"{len(unfinished)} of {len(planned)} runs not finished: {', '.join(unfinished)}; "
              "start the sweep again to continue them", file=out)
    return 1 if failed or unfinished else 0


def summarize(folder: os.PathLike, plot: Optional[os.PathLike] = None,
              out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    runs = find_runs(folder)
    if not runs:
        raise FileNotFoundError(f"no run directories in {folder} (folders holding config.yaml or "
                                "metrics.jsonl)")
    rows = [summarize_run(r) for r in runs]
    print(format_table(rows), file=out)
    if plot is not None:
        print(f"loss curves: {plot_summary(rows, plot)}", file=out)
    return 0


def print_plan(spec: SweepSpec, planned: List[PlannedRun], slurm: bool, out: TextIO) -> None:
    where = "SLURM nodes with GPUs" if slurm else "this machine"
    print(f"sweep {spec.name}: {len(planned)} run{'s' if len(planned) != 1 else ''} of "
          f"{spec.base}, checked for {where}", file=out)
    if spec.overrides:
        print(f"every run: {format_overrides(spec.overrides)}", file=out)
    rows = [("run", "run directory", "overrides")]
    rows += [(r.point.name, str(r.run_dir), format_overrides(r.point.values) or "-")
             for r in planned]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for row in rows:
        print(f"  {row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}", file=out)


def _sbatch_script(given: Optional[os.PathLike]) -> Path:
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise SubmitError(f"--sbatch-script {path}: no such file")
        return path.resolve()
    path = default_sbatch_script()
    if path is None:
        raise SubmitError("scripts/slurm/train.sbatch was not found next to the megatron_dmoe "
                          "package (is it installed without its repository?); pass "
                          "--sbatch-script PATH")
    return path
