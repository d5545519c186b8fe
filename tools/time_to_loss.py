r"""Time to quality: when did each run reach the dense model's (and the best capacity-factor MoE's)
final validation loss, in training wall-clock and in tokens?

Reads each run's metrics.jsonl and config.yaml. A run is labelled from its config: dense
(moe.num_experts 0), dMoE (no moe.expert_capacity_factor) or capacity-factor X. Time is the
training time of the run (metrics' train_time_s: training steps only, startup, evaluation and
checkpoint saving left out); runs that predate train_time_s get it rebuilt from their logged
tokens_per_s, which measures the same intervals. Between two evaluations, loss is interpolated
linearly in time and in tokens; the time to reach a loss is the first such crossing.

The reference times are the dense run's (and the best capacity-factor run's, the one with the
lowest final validation loss) first time at its own final validation loss, so speed-up = reference
time / the run's time to reach that loss; a run that never reaches it says so.

Writes one PNG (validation loss against training time and against tokens), a JSON file, and prints
a markdown table. RUN_DIR may also be a folder of runs (a sweep's runs folder).

Example:
  python tools/time_to_loss.py runs/time_to_quality --png ttq.png --json ttq.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONFIG_FILE = "config.yaml"


class ReportError(Exception):
    """A run that cannot be read or compared; one line for the user."""


@dataclass
class EvalPoint:
    step: int
    time_s: float  # training time at this step
    tokens: int  # training tokens consumed at this step
    val_loss: float


@dataclass
class Run:
    run_dir: Path
    label: str
    model: str  # dense | dmoe | capacity_factor
    capacity_factor: Optional[float]
    points: List[EvalPoint]
    steps: int  # last logged step
    train_time_s: float
    tokens: int
    time_source: str  # "train_time_s" (logged) or "tokens_per_s" (rebuilt)
    epochs: Optional[float] = None
    comparisons: Dict[str, Optional[dict]] = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float:
        return self.points[-1].val_loss

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.train_time_s if self.train_time_s > 0 else None


# -- reading runs ----------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_kind(cfg) -> Tuple[str, Optional[float], str]:
    """(model, capacity factor, label) of a run config."""
    if cfg.moe.num_experts == 0:
        return "dense", None, "dense"
    factor = cfg.moe.expert_capacity_factor
    if factor is None:
        return "dmoe", None, "dMoE"
    return "capacity_factor", float(factor), f"capacity-factor {float(factor)!r}"


def time_of_steps(records: List[Dict[str, Any]], tokens_per_step: int):
    """step -> training time, rebuilt from tokens_per_s for runs that did not log train_time_s.

    Each logged tokens_per_s covers the steps since the previous logged one (evaluation and
    checkpoint time excluded, as in train_time_s); a step between log records takes the rate of
    the next one (or the last, past the end).
    """
    windows = []  # (first step, last step, seconds per step)
    previous = 0
    for r in records:
        if _number(r.get("tokens_per_s")) and r["tokens_per_s"] > 0 and r["step"] > previous:
            windows.append((previous, r["step"], tokens_per_step / r["tokens_per_s"]))
            previous = r["step"]
    if not windows:
        return None

    def at(step: int) -> float:
        total = 0.0
        for begin, end, per_step in windows:
            if step <= end:
                return total + (step - begin) * per_step
            total += (end - begin) * per_step
        return total + (step - windows[-1][1]) * windows[-1][2]

    return at


def train_tokens(cfg) -> Optional[int]:
    """Tokens of one pass over the run's training data, when its data files can be read here."""
    if not cfg.data.data_path:
        return None  # the built-in corpus: its files live in a cache of the training machine
    from megatron_dmoe.data.checks import read_index, split_matrix  # megatron-core: seconds
    from megatron_dmoe.data.datasets import parse_blend

    try:
        prefixes, weights = parse_blend(cfg.data.data_path)
    except Exception:
        return None
    if weights is not None:
        return None  # a weighted blend has no single epoch
    total = 0
    for prefix in prefixes:
        prefix = os.path.expanduser(prefix)
        if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
            return None
        info = read_index(prefix)
        if cfg.data.valid_data_path:
            total += info.num_tokens
        else:  # megatron-core's split by documents
            begin, end = split_matrix(cfg.data.split)[0] or (0.0, 0.0)
            n = len(info.sequence_lengths)
            total += int(info.sequence_lengths[int(round(begin * n)):int(round(end * n))].sum())
    return total or None


def read_run(run_dir: Path, label: Optional[str] = None, one_pass: Optional[int] = None) -> Run:
    """One run's evaluation points and totals; `one_pass`: tokens of one pass over its training
    data, where its data files cannot be read here (else read from them)."""
    from megatron_dmoe.config import ConfigError, load_config
    from megatron_dmoe.training.metrics_log import read_metrics

    config = run_dir / CONFIG_FILE
    if not config.is_file():
        raise ReportError(f"{run_dir}: no {CONFIG_FILE}; pass run directories written by "
                          "dmoe-train (or a folder of them)")
    try:
        cfg = load_config(str(config))
        records = read_metrics(run_dir)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        raise ReportError(f"{run_dir}: {err}") from None
    model, factor, default_label = model_kind(cfg)
    tokens_per_step = cfg.training.global_batch_size * cfg.model.seq_length
    logged_time = all(_number(r.get("train_time_s")) for r in records) and records
    rebuilt = None if logged_time else time_of_steps(records, tokens_per_step)
    if not logged_time and rebuilt is None:
        raise ReportError(f"{run_dir}: its metrics.jsonl has neither train_time_s nor "
                          "tokens_per_s, so its training time is unknown")

    def time_at(r):
        return float(r["train_time_s"]) if logged_time else rebuilt(r["step"])

    def tokens_at(r):
        return int(r["tokens"]) if _number(r.get("tokens")) else r["step"] * tokens_per_step

    points = [EvalPoint(r["step"], time_at(r), tokens_at(r), float(r["val_loss"]))
              for r in records if _number(r.get("val_loss"))]
    if not points:
        raise ReportError(f"{run_dir}: no validation loss in its metrics.jsonl; train with "
                          "training.eval_interval > 0")
    last = records[-1]
    run = Run(run_dir=run_dir, label=label or default_label, model=model,
              capacity_factor=factor, points=points, steps=last["step"],
              train_time_s=time_at(last), tokens=tokens_at(last),
              time_source="train_time_s" if logged_time else "tokens_per_s")
    one_pass = one_pass or train_tokens(cfg)
    run.epochs = run.tokens / one_pass if one_pass else None
    return run


# -- the arithmetic --------------------------------------------------------------------------------
def first_reach(points: Sequence[EvalPoint], target: float) -> Optional[Tuple[float, float]]:
    """(training time, tokens) when validation loss first reaches `target`, interpolated linearly
    between the evaluation before and the first one at or below it; None if it never does. At the
    first evaluation already: that evaluation's time (nothing earlier to interpolate from)."""
    previous = None
    for point in points:
        if point.val_loss <= target:
            if previous is None:
                return point.time_s, float(point.tokens)
            share = (previous.val_loss - target) / (previous.val_loss - point.val_loss)
            return (previous.time_s + share * (point.time_s - previous.time_s),
                    previous.tokens + share * (point.tokens - previous.tokens))
        previous = point
    return None


def compare(reference: Run, name: str, who: Sequence[Run]) -> None:
    """Store in each run of `who` when it reached `reference`'s final loss and its speed-up."""
    target = reference.final_val_loss
    ref_time, ref_tokens = first_reach(reference.points, target)
    for run in who:
        reached = first_reach(run.points, target)
        entry = {"reference": str(reference.run_dir), "reference_label": reference.label,
                 "target_val_loss": target, "reference_train_time_s": ref_time,
                 "reference_tokens": ref_tokens, "reached": reached is not None}
        if reached is not None:
            time_s, tokens = reached
            entry.update(train_time_s=time_s, tokens=tokens,
                         speedup=ref_time / time_s if time_s > 0 else None,
                         token_ratio=ref_tokens / tokens if tokens > 0 else None)
        run.comparisons[name] = entry


def pick_dense(runs: List[Run], dense_dir: Optional[str]) -> Optional[Run]:
    if dense_dir is not None:
        chosen = [r for r in runs if r.run_dir.resolve() == Path(dense_dir).resolve()]
        if not chosen:
            raise ReportError(f"--dense {dense_dir} is not one of the runs given")
        return chosen[0]
    dense = [r for r in runs if r.model == "dense"]
    if len(dense) > 1:
        raise ReportError("several dense runs (" + ", ".join(str(r.run_dir) for r in dense)
                          + "); name the reference with --dense RUN_DIR")
    return dense[0] if dense else None


def analyse(runs: List[Run], dense_dir: Optional[str] = None) -> Dict[str, Optional[Run]]:
    dense = pick_dense(runs, dense_dir)
    moe = [r for r in runs if r.model != "dense"]
    if dense is not None:
        compare(dense, "dense", [dense] + [r for r in moe if r is not dense])
    capacity = [r for r in runs if r.model == "capacity_factor"]
    best = min(capacity, key=lambda r: r.final_val_loss) if capacity else None
    if best is not None:
        compare(best, "best_capacity_factor", moe)
    return {"dense": dense, "best_capacity_factor": best}


# -- output -----------------------------------------------------------------------------------------
def _minutes(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _count(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= threshold:
            return f"{n / threshold:.2f}{suffix}"
    return f"{n:.0f}"


def _reach_cells(entry: Optional[dict]) -> List[str]:
    if entry is None:
        return ["-", "-"]
    if not entry["reached"]:
        return ["not reached", "-"]
    return [f"{_minutes(entry['train_time_s'])} / {_count(entry['tokens'])} tok",
            f"{entry['speedup']:.2f}x" if entry["speedup"] is not None else "-"]


def markdown_table(runs: List[Run], refs: Dict[str, Optional[Run]]) -> str:
    dense, best = refs["dense"], refs["best_capacity_factor"]
    dense_loss = f" ({dense.final_val_loss:.4f})" if dense else ""
    best_loss = f" ({best.label}, {best.final_val_loss:.4f})" if best else ""
    header = ["run", "model", "tokens/s", "training time", "tokens", "epochs", "final val loss",
              f"to dense loss{dense_loss}", "speed-up vs dense",
              f"to best capacity-factor loss{best_loss}", "speed-up vs best capacity-factor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in runs:
        cells = [r.run_dir.name, r.label, _count(r.tokens_per_s), _minutes(r.train_time_s),
                 _count(r.tokens), "-" if r.epochs is None else f"{r.epochs:.2f}",
                 f"{r.final_val_loss:.4f}"]
        cells += _reach_cells(r.comparisons.get("dense"))
        cells += _reach_cells(r.comparisons.get("best_capacity_factor"))
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if dense is None:
        notes.append("no dense run: no comparison with a dense model")
    if best is None:
        notes.append("no capacity-factor run: no comparison with a token-dropping MoE")
    rebuilt = [r.run_dir.name for r in runs if r.time_source != "train_time_s"]
    if rebuilt:
        notes.append("training time rebuilt from logged tokens/s (no train_time_s) for: "
                     + ", ".join(rebuilt))
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] if notes else lines)


def report(runs: List[Run], refs: Dict[str, Optional[Run]]) -> dict:
    def run_json(r: Run) -> dict:
        return {"run_dir": str(r.run_dir), "label": r.label, "model": r.model,
                "capacity_factor": r.capacity_factor, "steps": r.steps,
                "tokens_per_s": r.tokens_per_s, "train_time_s": r.train_time_s,
                "tokens": r.tokens, "epochs": r.epochs, "final_val_loss": r.final_val_loss,
                "time_source": r.time_source,
                "to_dense_loss": r.comparisons.get("dense"),
                "to_best_capacity_factor_loss": r.comparisons.get("best_capacity_factor"),
                "curve": [vars(p) for p in r.points]}
    return {"dense": str(refs["dense"].run_dir) if refs["dense"] else None,
            "best_capacity_factor": (str(refs["best_capacity_factor"].run_dir)
                                     if refs["best_capacity_factor"] else None),
            "runs": [run_json(r) for r in runs]}


def plot(runs: List[Run], refs: Dict[str, Optional[Run]], out_png: Path) -> Path:
    from matplotlib.figure import Figure  # Agg through Figure.savefig: no display, no pyplot

    fig = Figure(figsize=(13, 5), dpi=100, layout="constrained")
    by_time, by_tokens = fig.subplots(1, 2, sharey=True)
    for i, r in enumerate(runs):
        style = dict(color=f"C{i % 10}", marker="o", markersize=3, linewidth=1.3, label=r.label)
        by_time.plot([p.time_s / 60 for p in r.points], [p.val_loss for p in r.points], **style)
        by_tokens.plot([p.tokens for p in r.points], [p.val_loss for p in r.points], **style)
    for name, ref, line in (("dense", refs["dense"], ":"),
                            ("best capacity-factor", refs["best_capacity_factor"], "--")):
        if ref is not None:
            for ax in (by_time, by_tokens):
                ax.axhline(ref.final_val_loss, color="gray", linestyle=line, linewidth=1,
                           label=f"{name} final loss ({ref.final_val_loss:.3f})")
    by_time.set_xlabel("training time (minutes)")
    by_tokens.set_xlabel("training tokens")
    by_time.set_ylabel("validation loss")
    by_time.set_title("Validation loss against training time")
    by_tokens.set_title("Validation loss against tokens")
    for ax in (by_time, by_tokens):
        ax.grid(True, alpha=0.3)
    by_time.legend()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


# -- command line ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories written by dmoe-train, or folders of them (a sweep's "
                        "runs folder)")
    p.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="names of the runs, one per run in order (default: from each config: "
                        "dense, dMoE, capacity-factor X)")
    p.add_argument("--dense", metavar="RUN_DIR",
                   help="the dense reference run, when several dense runs are given")
    p.add_argument("--png", default="time_to_loss.png", metavar="FILE",
                   help="plot of validation loss against training time and tokens "
                        "(default time_to_loss.png)")
    p.add_argument("--json", default="time_to_loss.json", metavar="FILE",
                   help="every number of the table, plus each run's evaluation points "
                        "(default time_to_loss.json)")
    p.add_argument("--train-tokens", type=int, metavar="N",
                   help="tokens of one pass over the runs' training data, for the epochs column "
                        "where the data files are not readable here (e.g. tokens.train of "
                        "make_corpus's summary.json; default: read from the runs' data files)")
    return p


def expand_runs(paths: Sequence[str]) -> List[Path]:
    from megatron_dmoe.sweep.summary import find_runs

    runs = []
    for path in paths:
        try:
            found = find_runs(path)
        except FileNotFoundError as err:
            raise ReportError(str(err)) from None
        if not found:
            raise ReportError(f"{path}: no run directories in it (folders holding {CONFIG_FILE})")
        runs.extend(found)
    return runs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        if args.train_tokens is not None and args.train_tokens <= 0:
            raise ReportError(f"--train-tokens {args.train_tokens}: give the positive token count of "
                              "one pass over the training data")
        run_dirs = expand_runs(args.run_dirs)
        if args.labels is not None and len(args.labels) != len(run_dirs):
            raise ReportError(f"--labels got {len(args.labels)} names for {len(run_dirs)} runs: "
                              "give one per run")
        labels = args.labels or [None] * len(run_dirs)
        runs = [read_run(d, label, args.train_tokens) for d, label in zip(run_dirs, labels)]
        if args.labels is None:  # the same kind twice: tell them apart by directory name
            for r in runs:
                if sum(o.label == r.label for o in runs) > 1:
                    r.label = f"{r.label} ({r.run_dir.name})"
        refs = analyse(runs, args.dense)
    except ReportError as err:
        print(f"time_to_loss: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(runs, refs))
    out_json = Path(args.json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report(runs, refs), indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {plot(runs, refs, Path(args.png))} and {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
