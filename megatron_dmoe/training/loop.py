"""Train a dMoE GPT from a resolved, validated run configuration: `set_up_run` (setup.py) builds
the run, then the loop runs one step at a time, each step: train, log and evaluate when due,
save when due, stop when asked or out of time.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state as ps

from megatron_dmoe.config import RunConfig
from megatron_dmoe.model.gpt import padded_vocab_size
from megatron_dmoe.moe import update_expert_biases
from megatron_dmoe.parallel.distributed import DistEnv
from megatron_dmoe.training.checkpoint import checkpoint_dir, prune_checkpoints, save_checkpoint
from megatron_dmoe.training.cuda_graphs import release_layer_graphs
from megatron_dmoe.training.flops import mfu, model_flops_per_token
from megatron_dmoe.training.metrics_log import MetricsLogger, moe_log_values, over_pipeline
from megatron_dmoe.training.run_dir import RunDirError
from megatron_dmoe.training.setup import Run, parameters_gathered, release_after_training, run_loader, set_up_run
from megatron_dmoe.training.step import evaluate, mean_over_data_parallel, train_step
from megatron_dmoe.training.stops import WRITE_FAILED, PreemptionWatcher, resume_command, time_limit_reached
from megatron_dmoe.training.wandb_log import wandb_settings
from megatron_dmoe.training.write_errors import free_space, write_failure


@dataclass
class TrainResult:
    run_dir: Path
    iteration: int
    losses: List[float] = field(default_factory=list)  # per logged step, on rank 0
    val_loss: Optional[float] = None
    val_step: Optional[int] = None  # the step val_loss was measured after
    preempted: bool = False
    out_of_time: bool = False  # stopped by training.time_limit_minutes
    stop_signal: Optional[str] = None  # SIGTERM or SIGINT when a signal stopped the run
    # a run file could not be written (metrics.jsonl on a full disk): the run stopped after saving;
    # the one line to tell (rank 0; the other ranks stopped with it and have nothing to add)
    write_error: Optional[str] = None


def _num_micro_batches(cfg: RunConfig) -> int:
    tr = cfg.training
    return tr.global_batch_size // (tr.micro_batch_size * ps.get_data_parallel_world_size())


@dataclass
class _Window:
    """The steps since the last log line, whose mean loss and throughput the next one reports."""
    loss: torch.Tensor  # summed on the device: no per-step sync
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0
        self.loss.zero_()


@dataclass
class _Loop:
    """The training loop's state from one step to the next."""
    run: Run
    train_data: Any
    logger: MetricsLogger
    watcher: PreemptionWatcher
    result: TrainResult
    num_micro: int
    tokens_per_step: int
    flops_per_token: float
    first_step: int  # logged whatever the interval: a sign of life in seconds
    out_of_time: bool
    window: _Window


def train(cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool, overwrite: bool = False,
          notices: Sequence[str] = ()) -> TrainResult:
    """Run the whole training; `cfg` is resolved and validated, process groups are initialised.

    Nothing in `run_dir` changes until the data, the model and (on resume) the checkpoint are
    loaded: then `overwrite` deletes a previous run's files and the resolved config is written.
    """
    run = set_up_run(cfg, env, run_dir, resume, overwrite, notices)
    loop = _start_loop(run)
    try:
        while run.progress.iteration < run.cfg.training.train_iters and not loop.out_of_time:
            if _run_one_step(loop):
                break
    finally:
        release_layer_graphs(run.model)
        release_after_training(run.model)
        loop.train_data.close()
        loop.watcher.close()
        # after a failed write the file (or TensorBoard's events) may refuse to flush again
        with contextlib.suppress(OSError) if loop.result.write_error else contextlib.nullcontext():
            loop.logger.close()
    result = loop.result
    result.iteration = run.progress.iteration
    result.out_of_time = loop.out_of_time
    if env.is_main and run.cfg.logging.plot and not result.preempted:
        try:
            _plot(run)
        except OSError as err:  # a full disk at the very end: the run itself is complete
            reason = write_failure(err)
            if reason is None:
                raise
            print(f"dmoe-train: warning: cannot write the plots in {run.run_dir}: {reason} "
                  f"({free_space(run.run_dir)} free there); checkpoints and metrics.jsonl are complete: draw "
                  f"them later with tools/plot_runs.py {run.run_dir} --out loss.png", file=sys.stderr)
    return result


def _start_loop(run: Run) -> _Loop:
    """The loader from where the run stands, the metrics logger and its opening lines, the signal
    watcher; the model in training mode."""
    cfg, env, progress = run.cfg, run.env, run.progress
    tr = cfg.training
    num_micro = _num_micro_batches(cfg)
    train_data = run_loader(cfg, run.data.train, progress.consumed_samples)
    tokens_per_step = tr.global_batch_size * cfg.model.seq_length
    flops_per_token = model_flops_per_token(cfg, vocab_size=padded_vocab_size(run.data.vocab_size, cfg))
    logger = MetricsLogger(
        run.run_dir,
        enabled=env.is_main,
        tensorboard=cfg.logging.tensorboard,
        progress_bar=cfg.logging.progress_bar,
        total_steps=tr.train_iters,
        start_step=progress.iteration,
        tensorboard_dir=cfg.logging.tensorboard_dir,
        wandb=wandb_settings(cfg, run.run_dir),
    )
    if run.started_from is not None:
        logger.message(f"started from {run.started_from} at step {progress.iteration}")
    elif progress.iteration:
        logger.message(f"resumed from {checkpoint_dir(run.ckpt_root, progress.iteration)}")
    first_step = progress.iteration + 1
    every = cfg.logging.log_interval
    # a resumed run whose time budget is already spent trains no further
    out_of_time = time_limit_reached(progress.train_time_s, tr.time_limit_minutes, env.device)
    if out_of_time:
        logger.message(f"training.time_limit_minutes={tr.time_limit_minutes} was spent at step "
                       f"{progress.iteration}: nothing left to train; raise it to train further")
    elif first_step > tr.train_iters:
        logger.message(f"training.train_iters={tr.train_iters} was reached at step {progress.iteration}: "
                       "nothing left to train; raise it to train further")
    else:
        steps = f"every {every} step{'s' if every > 1 else ''}"
        shown = (f"a progress bar (metrics.jsonl logs step {first_step}, then {steps})" if logger.shows_bar
                 else f"a log line after step {first_step}, then {steps}")
        logger.message(f"training: steps {first_step} to {tr.train_iters}, {tokens_per_step} tokens per step, {shown}")
    watcher = PreemptionWatcher(env.device)
    watcher.saves = cfg.checkpoint.save_interval != 0  # what its acknowledgement of a signal says
    result = TrainResult(run_dir=run.run_dir, iteration=progress.iteration)
    run.run_state.metrics.megatron_tracker = False  # this loop logs the sums itself
    for chunk in run.model:
        chunk.train()
    loop = _Loop(run=run, train_data=train_data, logger=logger, watcher=watcher, result=result,
                 num_micro=num_micro, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                 first_step=first_step, out_of_time=out_of_time,
                 window=_Window(loss=torch.zeros((), device=env.device)))
    return loop


def _run_one_step(loop: _Loop) -> bool:
    """Train one step, log, evaluate and save when due; True when the run stops here."""
    run = loop.run
    tr, progress = run.cfg.training, run.progress
    step_start = time.perf_counter()
    grad_norm, applied = _train_one_step(loop)
    step = progress.iteration
    # the first step logs too: a sign of life within seconds of the start
    log_due = step % run.cfg.logging.log_interval == 0 or step == tr.train_iters or step == loop.first_step
    if log_due and run.env.on_cuda:
        torch.cuda.synchronize()
    progress.train_time_s += time.perf_counter() - step_start
    loop.out_of_time = time_limit_reached(progress.train_time_s, tr.time_limit_minutes, run.env.device)
    last = step == tr.train_iters or loop.out_of_time

    loop.logger.advance(step)
    values = _window_values(loop, grad_norm, applied) if log_due or last else None
    values = _evaluate_if_due(loop, step, last, values)
    if values is not None:
        values["train_time_s"] = progress.train_time_s  # seconds of training steps so far
        values["tokens"] = progress.consumed_samples * run.cfg.model.seq_length
        _log_or_stop(loop, step, values)

    stop_signal = loop.watcher.should_stop()
    _save_if_due(loop, step, last, stop_signal)
    return _stopped(loop, step, stop_signal)


def _log_or_stop(loop: _Loop, step: int, values: Dict[str, Any]) -> None:
    """Log the step; when metrics.jsonl (or TensorBoard's events) cannot be written for space or
    permissions, every rank stops at this step and saves, and the run ends with one line."""
    try:
        loop.logger.log(step, values)
    except OSError as err:
        reason = write_failure(err)
        if reason is None:
            raise
        path = Path(err.filename) if err.filename else loop.logger.path
        loop.result.write_error = (f"cannot write {path}: {reason} ({free_space(path.parent)} free there); "
                                   f"step {step} is not logged")
        with contextlib.suppress(OSError):  # the file's unwritten buffer is dropped with it
            loop.logger.close()
        loop.watcher.write_failed()


def _train_one_step(loop: _Loop):
    """Forward, backward and optimizer step over one global batch; (grad_norm, whether applied)."""
    run = loop.run
    cfg, progress = run.cfg, run.progress
    loss, grad_norm, applied = train_step(run.model, run.optimizer, loop.train_data, loop.num_micro,
                                          run.env.device, run.run_state, cfg.moe.expert_wgrad_per_step,
                                          graphs_must_fit=run.graphs_must_fit)
    if applied:
        run.scheduler.step(1)
        if cfg.moe.router_enable_expert_bias:
            update_expert_biases(run.model)
    progress.iteration += 1
    progress.consumed_samples += cfg.training.global_batch_size
    loop.window.steps += 1
    loop.window.loss += loss
    return grad_norm, applied


def _window_values(loop: _Loop, grad_norm, applied: bool) -> Dict[str, Any]:
    """The log line's values over the steps since the last one; starts the next window."""
    run, window = loop.run, loop.window
    cfg, env = run.cfg, run.env
    elapsed = time.perf_counter() - window.start
    tokens_per_s = window.steps * loop.tokens_per_step / elapsed
    tflops = loop.flops_per_token * tokens_per_s / env.world_size / 1e12
    values = {
        "loss": mean_over_data_parallel(window.loss / window.steps),  # mean over the window
        "lr": run.optimizer.param_groups[0]["lr"],
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": mfu(tflops, cfg.logging.peak_tflops) if cfg.logging.peak_tflops else None,
        "skipped_update": not applied,
        # the peak of memory allocated on this GPU so far (captured graphs' pools included)
        "peak_memory_gib": torch.cuda.max_memory_allocated(env.device) / 2**30 if env.on_cuda else None,
    }
    moe_metrics = run.run_state.metrics
    values.update(moe_log_values(over_pipeline(moe_metrics.snapshot(group=ps.get_data_parallel_group()))))
    moe_metrics.reset()
    loop.result.losses.append(values["loss"])
    window.restart()
    return values


def _evaluate_if_due(loop: _Loop, step: int, last: bool,
                     values: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """`values` with val_loss added on evaluation steps (training.eval_interval, and the last)."""
    run = loop.run
    cfg, tr = run.cfg, run.cfg.training
    if not (tr.eval_interval and (step % tr.eval_interval == 0 or last)):
        return values
    values = values or {}
    # read in this process: a worker forked for each evaluation, while the run's threads (gloo's,
    # the checkpoint writer's) are live, can hang in CPython's after-fork cleanup on a lock one of
    # them held (seen once: a 4-process CPU run waited at its last evaluation until killed)
    with run_loader(cfg, run.data.valid, 0, num_workers=0) as valid, parameters_gathered(run.model):
        values["val_loss"] = evaluate(run.model, valid, tr.eval_iters, loop.num_micro, run.env.device)
    loop.result.val_loss, loop.result.val_step = values["val_loss"], step
    loop.window.start = time.perf_counter()  # evaluation time is not training throughput
    return values


def _save_if_due(loop: _Loop, step: int, last: bool, stop_signal: Optional[str]) -> None:
    """A checkpoint every checkpoint.save_interval steps, and at the last step or on a stop signal
    (unless the interval is 0)."""
    run = loop.run
    interval = run.cfg.checkpoint.save_interval
    if (interval and step % interval == 0) or ((last or stop_signal) and interval != 0):
        # older checkpoints are pruned after the line that tells the save, and said so
        with parameters_gathered(run.model):
            path = save_checkpoint(run.ckpt_root, run.model, run.optimizer, run.scheduler, run.progress, keep_last=0)
        loop.logger.message(f"saved checkpoint {path}")
        if run.env.is_main:
            keep_last = run.cfg.checkpoint.keep_last
            for old in prune_checkpoints(run.ckpt_root, keep_last, keep=step):
                loop.logger.message(f"deleted checkpoint {old} (checkpoint.keep_last={keep_last} keeps the newest "
                                    f"{keep_last}; 0 keeps all)")
        loop.window.start = time.perf_counter()


def _stopped(loop: _Loop, step: int, stop_signal: Optional[str]) -> bool:
    """Whether a stop signal or training.time_limit_minutes ends the run at this step (saying so)."""
    run = loop.run
    tr = run.cfg.training
    if stop_signal == WRITE_FAILED:
        _end_on_write_error(loop, step)
    if stop_signal:
        if run.cfg.checkpoint.save_interval == 0:
            loop.logger.message(f"stopping at step {step} on {stop_signal}; no checkpoint saved "
                                "(checkpoint.save_interval is 0)")
        else:
            loop.logger.message(f"stopping at step {step} on {stop_signal}; continue with: "
                                f"{resume_command(run.run_dir)}")
        loop.result.preempted = True
        loop.result.stop_signal = stop_signal
        return True
    if loop.out_of_time:
        loop.logger.message(f"stopping at step {step}: training.time_limit_minutes="
                            f"{tr.time_limit_minutes} spent ({run.progress.train_time_s / 60:.2f} "
                            "minutes of training steps)")
        return True
    return False


def _end_on_write_error(loop: _Loop, step: int) -> None:
    """A run file could not be written: the checkpoint of `step` is saved (unless saving is off);
    raise RunDirError with the one line on rank 0, on the other ranks a quiet stop."""
    run = loop.run
    saved = (f"the checkpoint of step {step} is saved"
             if run.cfg.checkpoint.save_interval != 0 else "no checkpoint saved (checkpoint.save_interval is 0)")
    text = loop.result.write_error
    if text is None:
        raise RunDirError("")  # rank 0 tells why
    raise RunDirError(f"{text}; {saved}; make room (or fix the permissions), then continue with: "
                      f"{resume_command(run.run_dir)}")


def _plot(run: Run) -> None:
    from megatron_dmoe.training.plots import plot_expert_load, plot_runs

    plot_runs([run.run_dir], run.run_dir / "loss.png")
    if run.cfg.moe.num_experts > 0:
        plot_expert_load(run.run_dir, run.run_dir / "expert_load.png")
