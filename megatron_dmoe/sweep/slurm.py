"""Submit a sweep as ONE SLURM job array: task i trains the run directory on line i+1 of runs.txt.

The array's tasks run scripts/slurm/train.sbatch, which reads the list from the RUN_LIST
environment variable, trains the run from its config.yaml with --resume, and requeues itself when
preempted or near its time limit.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

import megatron_dmoe

SBATCH_SCRIPT = Path("scripts") / "slurm" / "train.sbatch"


class SubmitError(RuntimeError):
    """sbatch is missing, or refused the job; the message says what to do."""


def default_sbatch_script() -> Optional[Path]:
    """scripts/slurm/train.sbatch of the repository this package is imported from, if present."""
    path = Path(megatron_dmoe.__file__).resolve().parents[1] / SBATCH_SCRIPT
    return path if path.is_file() else None


def find_sbatch() -> str:
    path = shutil.which("sbatch")
    if path is None:
        raise SubmitError("sbatch was not found on PATH: run dmoe-sweep --slurm on a SLURM login "
                          "node, or without --slurm to run the sweep here")
    return path


def sbatch_options(options: Dict[str, Any]) -> List[str]:
    """``{"partition": "gpu", "exclusive": True}`` -> ``["--partition=gpu", "--exclusive"]``."""
    return [f"--{name}" if value is True else f"--{name}={value}" for name, value in options.items()]


def sbatch_command(sbatch: str, script: Path, num_runs: int, runs_dir: Path, job_name: str,
                   options: Dict[str, Any]) -> List[str]:
    # The sweep file's options come after ours so that they win (sbatch keeps the last value).
    return [sbatch, "--parsable", f"--array=0-{num_runs - 1}", f"--job-name={job_name}",
            f"--output={runs_dir.resolve() / 'slurm-%A_%a.out'}", "--export=ALL",
            *sbatch_options(options), str(script)]


def submit_array(run_list: Path, num_runs: int, job_name: str, script: Path,
                 options: Dict[str, Any], sbatch: Optional[str] = None) -> str:
    """Submit the array; returns its job id."""
    command = sbatch_command(sbatch or find_sbatch(), script, num_runs, run_list.parent, job_name,
                             options)
    env = dict(os.environ, RUN_LIST=str(run_list.resolve()))
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise SubmitError(f"sbatch refused the job array (exit status {proc.returncode}): {detail}")
    return proc.stdout.strip().split(";")[0]
