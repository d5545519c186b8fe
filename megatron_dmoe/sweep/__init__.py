"""Config sweeps: a base config, overrides, and grid/zip values expanded into runs that train here
(one after another, or several at once on GPUs of their own) or as one SLURM job array; plus a
summary table and loss plots of the runs.

Names are imported on first use, so `python -m megatron_dmoe.sweep.status` (which launchers
call) and the listing and summary commands start quickly and without torch.
"""
import importlib

_EXPORTS = {
    "SweepError": "errors",
    "SweepSpec": "spec",
    "load_sweep": "spec",
    "SweepPoint": "points",
    "expand": "points",
    "PlannedRun": "runs",
    "plan_runs": "runs",
    "write_runs": "runs",
    "RunStatus": "status",
    "run_status": "status",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
