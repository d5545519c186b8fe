"""Training metrics: a JSON line per logged step, TensorBoard scalars, a progress bar or log line.

RUN_DIR/metrics.jsonl is the record plots and analyses read: each line is one JSON object with at
least ``step``; the training loop logs loss, lr, grad_norm, tokens_per_s, tflops_per_gpu, mfu,
peak_memory_gib (CUDA: the most memory allocated on the GPU so far),
lb_loss, z_loss, expert_load_imbalance (one float per MoE layer), expert_load (per MoE layer, one
value per expert), val_loss on evaluation steps, and on every record train_time_s (seconds spent in
training steps since the run began, summed over resumed pieces; startup, evaluation and checkpoint
saving left out) and tokens (training tokens consumed). Any other key passes through unchanged.
Non-finite floats are written as NaN / Infinity, which Python's json module reads back.

With pipeline parallelism each stage holds different MoE layers: `over_pipeline` gathers them
into the whole model's MoE metrics before they are logged.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PROGRESS_BAR_CHOICES = ("auto", "on", "off")
NOT_SCALARS = ("step", "moe_layers")  # not sent to TensorBoard: the x axis, and layer numbers

PathLike = Union[str, os.PathLike]


class MetricsLogger:
    """Writes the metrics of one run; ranks other than 0 pass ``enabled=False`` (all calls no-ops).

    ``start_step`` is the last step already done: on resume (> 0) lines of metrics.jsonl with a
    larger step are removed before appending, so a run resumed from an earlier checkpoint never
    repeats steps; 0 starts the file afresh. TensorBoard gets the same cut through ``purge_step``.
    ``progress_bar``: 'on', 'off', or 'auto' (a bar only when stdout is a terminal); without a bar
    each ``log`` call prints one compact line instead.
    """

    def __init__(self, run_dir: PathLike, enabled: bool = True, tensorboard: bool = True,
                 progress_bar: str = "auto", total_steps: Optional[int] = None,
                 start_step: int = 0, tensorboard_dir: Optional[PathLike] = None, wandb=None):
        if progress_bar not in PROGRESS_BAR_CHOICES:
            raise ValueError(f"logging.progress_bar={progress_bar!r}: use one of "
                             + ", ".join(repr(c) for c in PROGRESS_BAR_CHOICES))
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.total_steps = total_steps
        self.start_step = start_step
        self._file = None
        self._writer = None
        self._wandb = None
        self._bar = None
        self._postfix: Dict[str, str] = {}  # the bar's latest values, kept across log calls
        self.path = self.run_dir / METRICS_FILE
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            self._writer = _summary_writer(Path(tensorboard_dir or self.run_dir / TENSORBOARD_DIR), start_step)
        if wandb is not None:  # a WandbSettings (training/wandb_log.py)
            self._wandb = wandb.start(start_step)
        if progress_bar == "on" or (progress_bar == "auto" and _stdout_is_terminal()):
            self._bar = _progress_bar(total_steps, start_step)

    def log(self, step: int, values: Dict[str, Any]) -> None:
        """Append ``{"step": step, **values}`` to metrics.jsonl and show it (bar or log line).

        Values may be numbers, strings, None, (nested) lists, or tensors / numpy arrays (converted
        with ``tolist()``). The line is flushed at once, so a killed run keeps what it logged.
        """
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger of {self.run_dir} was closed: log before close()")
        if "step" in values and values["step"] != step:
            raise ValueError(f"values['step']={values['step']!r} disagrees with step={step}")
        record = {"step": int(step)}
        for key, value in values.items():
            if key != "step":
                record[str(key)] = _jsonable(value, key)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            _write_scalars(self._writer, record)
        if self._wandb is not None:
            self._wandb.log(scalars(record), step=record["step"])
        if self._bar is not None:
            _update_bar(self._bar, self._postfix, record)
        else:
            print(format_log_line(record, self.total_steps), flush=True)

    @property
    def shows_bar(self) -> bool:
        """Whether the console shows a progress bar (no log lines) on this rank."""
        return self._bar is not None

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` without logging (for steps between log intervals)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Flush and close the file, the TensorBoard writer and the bar; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
            import wandb

            # stop wandb's service process now: left to its exit hook, a process that ran training
            # in-process (the tests, a notebook) prints a traceback when the service has gone first
            wandb.teardown()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def metrics_path(path_or_run_dir: PathLike) -> Path:
    """The metrics.jsonl of a run directory (a file path is returned as it is)."""
    path = Path(path_or_run_dir)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(path_or_run_dir: PathLike) -> List[Dict[str, Any]]:
    """All records of a metrics.jsonl (or of RUN_DIR/metrics.jsonl), in file order.

    An incomplete last line (a run killed while writing) is skipped; a broken line elsewhere
    raises ValueError naming the file and line.
    """
    path = metrics_path(path_or_run_dir)
    if not path.is_file():
        where = (f"no {METRICS_FILE} in {path.parent}" if path.name == METRICS_FILE
                 else f"no file {path}")
        raise FileNotFoundError(
            f"{where}: pass a run directory written by training (it holds {METRICS_FILE}) "
            "or the path of a metrics file")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it: cut off mid-write
                continue
            raise ValueError(f"{path}, line {number}: not valid JSON ({error})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}, line {number}: expected a JSON object with a 'step' key")
        records.append(record)
    return records


def truncate_metrics(path: PathLike, start_step: int) -> None:
    """Keep only records with step <= start_step (none when start_step is 0); atomic rewrite."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    if start_step > 0:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut off by a killed run
                if isinstance(record, dict) and record.get("step", math.inf) <= start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def format_log_line(record: Dict[str, Any], total_steps: Optional[int] = None) -> str:
    """One compact line: ``step 20/300 | loss 5.123 | lr 1.9e-03 | grad 0.84 | 12.3k tok/s ...``."""
    step = record["step"]
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    fields = (
        ("loss", "loss {:.4g}"),
        ("val_loss", "val {:.4g}"),
        ("lr", "lr {:.1e}"),
        ("grad_norm", "grad {:.3g}"),
        ("tokens_per_s", None),
        ("tflops_per_gpu", "{:.3g} TFLOP/s"),
        ("mfu", None),
        ("peak_memory_gib", "peak mem {:.1f} GiB"),
        ("lb_loss", "lb {:.3g}"),
        ("z_loss", "z {:.3g}"),
        ("expert_load_imbalance", None),
    )
    for key, template in fields:
        value = record.get(key)
        if key == "expert_load_imbalance" and isinstance(value, list):
            numbers = [v for v in value if _is_number(v)]
            if numbers:  # the worst layer; metrics.jsonl keeps every layer's value
                layers = f"max of {len(numbers)} layers" if len(numbers) > 1 else "1 layer"
                parts.append(f"imbalance {max(numbers):.3g} ({layers})")
        elif not _is_number(value):
            continue
        elif key == "tokens_per_s":
            parts.append(f"{_human(value)} tok/s")
        elif key == "mfu":
            parts.append(f"MFU {100 * value:.1f}%")
        else:
            parts.append(template.format(value))
    return " | ".join(parts)


def moe_log_values(snapshot: Dict[str, Any]) -> Dict[str, Any]:
    """The metrics.jsonl keys for one MoE tracker snapshot (``MoEMetrics.snapshot()``).

    The snapshot keys layers by layer number (``{"layers": {n: {"load": [...],
    "load_imbalance": x, ...}}, "lb_loss": ..., "z_loss": ...}``); the log wants per-layer lists in
    layer order: ``expert_load_imbalance`` (None for a layer without one), ``expert_load`` (when
    every layer recorded its load), ``moe_layers`` (the layer numbers), plus ``lb_loss`` and
    ``z_loss`` averaged over layers when recorded.
    """
    values = {key: snapshot[key] for key in ("lb_loss", "z_loss") if key in snapshot}
    layers = snapshot.get("layers") or {}
    numbers = sorted(layers, key=int)
    if numbers:
        values["moe_layers"] = [int(n) for n in numbers]
        values["expert_load_imbalance"] = [layers[n].get("load_imbalance") for n in numbers]
        if all(layers[n].get("load") is not None for n in numbers):
            values["expert_load"] = [list(layers[n]["load"]) for n in numbers]
    return values


def over_pipeline(snapshot: Dict[str, Any]) -> Dict[str, Any]:
    """A `MoEMetrics.snapshot()` of every pipeline stage's layers, on every stage: the per-layer
    values are gathered over the pipeline group and the averages over layers formed again (the
    snapshot as is without pipeline parallelism)."""
    # here, not at the top: sweep summaries and plotting tools read metrics without megatron-core
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return snapshot
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, snapshot.get("layers") or {}, group=ps.get_pipeline_model_parallel_group())
    layers = {n: layer for part in parts for n, layer in part.items()}
    if not layers:
        return {}
    merged: Dict[str, Any] = {"layers": layers}
    for key in ("lb_loss", "z_loss"):
        values = [layer[key] for layer in layers.values() if key in layer]
        if values:
            merged[key] = sum(values) / len(values)
    imbalances = [layer["load_imbalance"] for layer in layers.values() if "load_imbalance" in layer]
    if imbalances:
        merged["load_imbalance"] = sum(imbalances) / len(imbalances)
        merged["load_imbalance_max"] = max(imbalances)
    return merged


def _jsonable(value: Any, key: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        if hasattr(value, "detach"):
            value = value.detach()
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, key) for k, v in value.items()}
    raise TypeError(f"metric {key!r}: cannot write a {type(value).__name__} to JSON; "
                    "log numbers, strings, lists or tensors")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _human(value: float) -> str:
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


def scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """A record's scalars, as TensorBoard and W&B get them: numbers under their key; flat lists (one
    value per MoE layer) as KEY/layer_N, skipping None entries. N is the layer's number in the model
    as `moe_layers` logs it (the numbers metrics.jsonl and the plots use, counting from 1), else its
    place from 1."""
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        if _is_number(value):
            out[key] = value
        elif isinstance(value, list) and all(_is_number(v) or v is None for v in value):
            numbers = record.get("moe_layers")
            if not (isinstance(numbers, list) and len(numbers) == len(value)):
                numbers = range(1, len(value) + 1)
            for layer, v in zip(numbers, value):
                if v is not None:
                    out[f"{key}/layer_{layer}"] = v
    return out


def _write_scalars(writer, record: Dict[str, Any]) -> None:
    for key, value in scalars(record).items():
        writer.add_scalar(key, value, record["step"])
    writer.flush()


def _summary_writer(log_dir: Path, start_step: int):
    from torch.utils.tensorboard import SummaryWriter  # imported here: it takes a few seconds

    # TensorBoard discards earlier events with step >= purge_step, matching the jsonl cut.
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else 0)


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def _progress_bar(total_steps: Optional[int], start_step: int):
    from tqdm import tqdm

    return tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout,
                dynamic_ncols=True, smoothing=0.1)


def _update_bar(bar, postfix: Dict[str, str], record: Dict[str, Any]) -> None:
    if record["step"] > bar.n:
        bar.update(record["step"] - bar.n)
    if _is_number(record.get("loss")):
        postfix["loss"] = f"{record['loss']:.4g}"
    if _is_number(record.get("val_loss")):
        postfix["val"] = f"{record['val_loss']:.4g}"
    if _is_number(record.get("lr")):
        postfix["lr"] = f"{record['lr']:.1e}"
    if _is_number(record.get("tokens_per_s")):
        postfix["tok/s"] = _human(record["tokens_per_s"])
    if postfix:
        bar.set_postfix(postfix, refresh=True)  # tqdm copies the dict
