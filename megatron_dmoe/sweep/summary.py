"""A table of the runs in a folder (steps, final losses, throughput) and their loss curves together."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megatron_dmoe.training.metrics_log import METRICS_FILE, read_metrics

from .runs import RUN_LIST
from .status import CONFIG_FILE, run_status


@dataclass(frozen=True)
class RunSummary:
    name: str
    run_dir: Path
    step: Optional[int]  # last logged step
    train_iters: Optional[int]
    train_loss: Optional[float]  # last logged training loss
    val_loss: Optional[float]  # last validation loss
    tokens_per_s: Optional[float]  # mean over logged intervals, the first (start-up) left out


def find_runs(folder: os.PathLike) -> List[Path]:
    """The run directories in ``folder`` (sub-folders with a config.yaml or metrics.jsonl), in the
    sweep's order when it has a runs.txt, then by name; ``folder`` itself when it is a run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass a sweep's runs folder "
                                "(e.g. runs/<sweep name>) or a run directory")
    if _is_run(folder):
        return [folder]
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and _is_run(p))
    listed = folder / RUN_LIST
    if listed.is_file():
        names = [Path(line).name for line in listed.read_text(encoding="utf-8").splitlines() if line]
        order = {name: i for i, name in enumerate(names)}
        runs.sort(key=lambda p: (order.get(p.name, len(order)), p.name))
    return runs


def _is_run(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or (path / METRICS_FILE).is_file()


def summarize_run(run_dir: os.PathLike) -> RunSummary:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    throughput = [v for v in _values(records, "tokens_per_s")]
    if len(throughput) > 1:
        throughput = throughput[1:]  # the first interval includes start-up (data, first steps)
    return RunSummary(
        name=run_dir.name,
        run_dir=run_dir,
        step=records[-1]["step"] if records else None,
        train_iters=run_status(run_dir).train_iters,
        train_loss=_last(records, "loss"),
        val_loss=_last(records, "val_loss"),
        tokens_per_s=sum(throughput) / len(throughput) if throughput else None,
    )


def _values(records: List[Dict[str, Any]], key: str) -> List[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool) and math.isfinite(r[key])]


def _last(records: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = _values(records, key)
    return values[-1] if values else None


def format_table(rows: Sequence[RunSummary]) -> str:
    header = ("run", "steps", "train loss", "val loss", "tokens/s")
    lines = [header]
    for row in rows:
        steps = "-" if row.step is None else str(row.step)
        if row.train_iters is not None:
            steps += f"/{row.train_iters}"
        lines.append((row.name, steps, _number(row.train_loss, "{:.4f}"),
                      _number(row.val_loss, "{:.4f}"), _number(row.tokens_per_s, "{:.0f}")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        text.append("  ".join(cells).rstrip())
    return "\n".join(text)


def _number(value: Optional[float], template: str) -> str:
    return "-" if value is None else template.format(value)


def plot_summary(rows: Sequence[RunSummary], out_png: os.PathLike) -> Path:
    """Loss curves of the runs that logged a loss, in one PNG (training.plots.plot_runs)."""
    from megatron_dmoe.training.plots import plot_runs  # matplotlib: only when plotting

    plotted = [r for r in rows if r.train_loss is not None or r.val_loss is not None]
    if not plotted:
        raise ValueError("none of the runs has logged a loss yet: nothing to plot")
    return plot_runs([r.run_dir for r in plotted], out_png, labels=[r.name for r in plotted])
