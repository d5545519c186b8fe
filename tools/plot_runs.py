#!/usr/bin/env python
"""Plot the loss curves of one or several training runs, and the expert load of MoE runs.

    python tools/plot_runs.py runs/dmoe runs/dense --out loss.png --labels dMoE dense
    python tools/plot_runs.py runs/dmoe --out loss.png --expert-load experts.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_dmoe.training.plots import default_labels, plot_expert_load, plot_runs


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Draw training loss (lines) and validation loss (markers) against step for "
                    "one or several run directories into one PNG, read from each run's "
                    "metrics.jsonl.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directory written by training (it holds metrics.jsonl)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="PNG file to write the loss plot to")
    parser.add_argument("--labels", nargs="+", metavar="LABEL",
                        help="legend name of each run, one per RUN_DIR in the same order "
                             "(default: the run directories' names)")
    parser.add_argument("--expert-load", metavar="FILE",
                        help="also draw a heatmap of the fraction of tokens per expert and MoE "
                             "layer plus the load imbalance over steps; with several runs, one PNG "
                             "per MoE run named FILE's stem + '-LABEL.png'; dense runs are skipped")
    parser.add_argument("--average", action="store_true",
                        help="with --expert-load: average the load over all logged steps instead "
                             "of showing the last logged step")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        parser.error(f"--labels got {len(args.labels)} names for {len(args.run_dirs)} run "
                     "directories: give one per RUN_DIR")
    return args


def expert_load_paths(out: Path, labels: List[str]) -> List[Path]:
    """FILE itself for one run; FILE's stem + '-LABEL' + suffix for each of several runs."""
    if len(labels) == 1:
        return [out]
    safe = ["".join(c if c.isalnum() or c in "-_." else "_" for c in label) for label in labels]
    return [out.with_name(f"{out.stem}-{name}{out.suffix or '.png'}") for name in safe]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    labels = args.labels or default_labels(args.run_dirs)
    try:
        print(f"wrote {plot_runs(args.run_dirs, args.out, labels=labels)}")
        if args.expert_load:
            targets = expert_load_paths(Path(args.expert_load), labels)
            for run_dir, target in zip(args.run_dirs, targets):
                if not _has_expert_load(run_dir) and len(args.run_dirs) > 1:
                    print(f"skipped {run_dir}: no expert_load logged (dense model?)")
                    continue
                print(f"wrote {plot_expert_load(run_dir, target, average=args.average)}")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _has_expert_load(run_dir: str) -> bool:
    from megatron_dmoe.training.metrics_log import read_metrics

    return any(record.get("expert_load") is not None for record in read_metrics(run_dir))


if __name__ == "__main__":
    sys.exit(main())
