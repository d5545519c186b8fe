"""PNG plots of runs from their metrics.jsonl: loss curves, and expert load of MoE runs.

Figures are drawn on matplotlib Figure objects and saved with the Agg renderer, without pyplot:
no display is needed and no global backend state is touched.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from .metrics_log import read_metrics

PathLike = Union[str, os.PathLike]
# Above this many heatmap cells the numbers would be unreadable; the colour bar alone is drawn.
MAX_ANNOTATED_CELLS = 64


def plot_runs(run_dirs: Sequence[PathLike], out_png: PathLike,
              labels: Optional[Sequence[str]] = None) -> Path:
    """Training loss against step (lines) and validation loss (markers) of one or several runs.

    ``labels`` names the runs in the legend (default: each run directory's name).
    Returns the PNG path.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if labels is None:
        labels = default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"got {len(labels)} labels for {len(run_dirs)} run directories: "
                         "give one label per run")

    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        records = read_metrics(run_dir)
        train = _series(records, "loss")
        val = _series(records, "val_loss")
        if not train[0] and not val[0]:
            raise ValueError(f"{run_dir}: its metrics.jsonl has no finite 'loss' or 'val_loss' "
                             "values to plot")
        color = f"C{index % 10}"
        if train[0]:
            ax.plot(*train, color=color, linewidth=1.2, label=f"{label} (train)")
        if val[0]:
            ax.plot(*val, "o", color=color, markersize=5, markeredgecolor="black",
                    markeredgewidth=0.5, label=f"{label} (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss" if len(run_dirs) == 1 else "Training loss of several runs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, out_png)


def plot_expert_load(run_dir: PathLike, out_png: PathLike, average: bool = False) -> Path:
    """Heatmap of each expert's fraction of tokens (MoE layers x experts), and imbalance over steps.

    Reads ``expert_load`` records (per MoE layer, one token count or fraction per expert; rows are
    normalised to fractions): the last one, or with ``average=True`` the mean over all logged steps.
    The right panel plots ``expert_load_imbalance`` per layer as logged; runs that did not log it
    get max/mean load computed from ``expert_load``. Returns the PNG path.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    steps, fractions = _load_fractions(run_dir, records)
    heat = fractions.mean(axis=0) if average else fractions[-1]
    imbalance_steps, imbalance, imbalance_label = _imbalance(records, steps, fractions)

    num_layers, num_experts = heat.shape
    names = _layer_names(records, num_layers)
    fig = Figure(figsize=(13, max(4.0, 0.45 * num_layers + 2.0)), dpi=100, layout="constrained")
    heat_ax, line_ax = fig.subplots(1, 2, width_ratios=[1.1, 1.0])
    uniform = 1.0 / num_experts
    # Blue below the uniform share 1/E, red above: over- and under-loaded experts stand out.
    norm = TwoSlopeNorm(vcenter=uniform, vmin=0.0, vmax=max(float(heat.max()), 2 * uniform))
    image = heat_ax.imshow(heat, cmap="coolwarm", norm=norm, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=heat_ax, label=f"fraction of tokens (uniform = 1/{num_experts})")
    heat_ax.set_xlabel("expert")
    heat_ax.set_ylabel("MoE layer")
    heat_ax.set_xticks(range(num_experts))
    heat_ax.set_yticks(range(num_layers), names)
    when = f"mean over {len(steps)} logged steps" if average else f"step {steps[-1]}"
    heat_ax.set_title(f"Expert load ({when})")
    if heat.size <= MAX_ANNOTATED_CELLS:
        for layer in range(num_layers):
            for expert in range(num_experts):
                value = heat[layer, expert]
                strong = abs(float(norm(value)) - 0.5) > 0.35  # dark cell: white text
                heat_ax.text(expert, layer, f"{value:.2f}", ha="center", va="center", fontsize=8,
                             color="white" if strong else "black")

    for layer in range(imbalance.shape[1]):
        line_ax.plot(imbalance_steps, imbalance[:, layer], linewidth=1.2,
                     label=f"layer {names[layer]}")
    line_ax.set_xlabel("step")
    line_ax.set_ylabel(imbalance_label)
    line_ax.set_title("Expert-load imbalance per MoE layer")
    line_ax.grid(True, alpha=0.3)
    if imbalance.shape[1] <= 12:
        line_ax.legend(fontsize=8)
    return _save(fig, out_png)


def default_labels(run_dirs: Sequence[PathLike]) -> List[str]:
    """Each run directory's name, or the paths as given when two names are the same."""
    run_dirs = [Path(d) for d in run_dirs]
    names = [d.resolve().name or str(d) for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in run_dirs]  # same folder names in different places: show the paths


def _series(records: List[Dict[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _expert_loads(run_dir: Path, records: List[Dict[str, Any]]) -> Tuple[List[int], np.ndarray]:
    steps, loads = [], []
    for record in records:
        if record.get("expert_load") is None:
            continue
        try:
            load = np.asarray(record["expert_load"], dtype=float)
        except ValueError:
            load = None  # ragged rows
        if load is None or load.ndim != 2 or load.size == 0:
            raise ValueError(f"{run_dir}, step {record['step']}: expert_load must be a list with "
                             "one list of per-expert values per MoE layer (all of the same length)")
        if loads and load.shape != loads[0].shape:
            raise ValueError(f"{run_dir}, step {record['step']}: expert_load has shape "
                             f"{list(load.shape)}, earlier steps {list(loads[0].shape)}")
        steps.append(record["step"])
        loads.append(load)
    if not loads:
        raise ValueError(f"{run_dir}: its metrics.jsonl has no 'expert_load' values; dense models "
                         "(moe.num_experts = 0) have no expert load to plot")
    return steps, np.stack(loads)


def _layer_names(records: List[Dict[str, Any]], num_layers: int) -> List[str]:
    """The model's layer numbers when the run logged ``moe_layers``, else 0, 1, ... in log order."""
    for record in reversed(records):
        numbers = record.get("moe_layers")
        if isinstance(numbers, list) and len(numbers) == num_layers:
            return [str(n) for n in numbers]
    return [str(n) for n in range(num_layers)]


def _load_fractions(run_dir: Path, records: List[Dict[str, Any]]) -> Tuple[List[int], np.ndarray]:
    """Steps and [steps, layers, experts] fractions (rows of zero tokens stay zero)."""
    steps, loads = _expert_loads(run_dir, records)
    totals = loads.sum(axis=2, keepdims=True)
    return steps, np.divide(loads, totals, out=np.zeros_like(loads), where=totals > 0)


def _imbalance(records: List[Dict[str, Any]], load_steps: List[int],
               fractions: np.ndarray) -> Tuple[List[int], np.ndarray, str]:
    steps, rows = [], []
    for record in records:
        value = record.get("expert_load_imbalance")
        if isinstance(value, list) and value and len(value) == fractions.shape[1]:
            steps.append(record["step"])
            rows.append([float("nan") if v is None else float(v) for v in value])
    if rows:
        return steps, np.asarray(rows, dtype=float), "expert_load_imbalance"
    return load_steps, fractions.max(axis=2) * fractions.shape[2], "max / mean expert load"


def _save(fig: Figure, out_png: PathLike) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
