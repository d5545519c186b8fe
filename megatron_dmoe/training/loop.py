"""Train a dMoE GPT from a resolved, validated run configuration.

The order matters for users: everything that can fail because of their input (config, data files,
tokenizer) fails before a model is built or a checkpoint is touched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dmoe.config import RunConfig
from megatron_dmoe.model.cuda_graphs_auto import resolve_cuda_graphs
from megatron_dmoe.model.gpt import build_model_chunks, padded_vocab_size
from megatron_dmoe.model.layer_seed import set_layer_init_seed
from megatron_dmoe.moe import MoERunState, update_expert_biases
from megatron_dmoe.parallel.distributed import DistEnv, seed_everything
from megatron_dmoe.training.checkpoint import (
    Progress,
    checkpoint_dir,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megatron_dmoe.training.data_setup import RunData, prepare_run_data, run_loader
from megatron_dmoe.training.flops import model_flops_per_token
from megatron_dmoe.training.metrics import METRICS_FILE, MetricsLogger, moe_log_values
from megatron_dmoe.training.model_setup import wrap_for_training
from megatron_dmoe.training.optim import build_optimizer, build_scheduler
from megatron_dmoe.training.pipeline_metrics import over_pipeline
from megatron_dmoe.training.preemption import PreemptionWatcher
from megatron_dmoe.training.run_dir import (
    checkpoint_root,
    previous_run_files,
    software_versions,
    write_run_config,
)
from megatron_dmoe.training.startup import describe_data, describe_device, describe_model
from megatron_dmoe.training.step import evaluate, mean_over_data_parallel, train_step
from megatron_dmoe.training.time_limit import time_limit_reached


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


def _num_micro_batches(cfg: RunConfig) -> int:
    tr = cfg.training
    return tr.global_batch_size // (tr.micro_batch_size * ps.get_data_parallel_world_size())




def train(cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool, overwrite: bool = False,
          notices: Sequence[str] = ()) -> TrainResult:
    """Run the whole training; `cfg` is resolved and validated, process groups are initialised.

    Nothing in `run_dir` changes until the data, the model and (on resume) the checkpoint are
    loaded: then `overwrite` deletes a previous run's files and the resolved config is written.
    """
    run_dir = Path(run_dir)
    # training.cuda_graphs: auto becomes true or false here, once; config.yaml records which
    cfg, graph_notes = resolve_cuda_graphs(cfg, env.on_cuda, env.world_size)
    notices = [*notices, *graph_notes]
    tr = cfg.training

    def say(text: str) -> None:
        if env.is_main:
            print(text, flush=True)

    for notice in notices:
        say(notice)
    say(f"run directory: {run_dir}")
    ckpt_root = checkpoint_root(run_dir)
    latest = latest_iteration(ckpt_root) if resume else None  # a new run ignores old checkpoints
    if resume and latest is None:
        afresh = f" ({METRICS_FILE} starts afresh)" if METRICS_FILE in previous_run_files(run_dir) else ""
        say(f"no checkpoint in {ckpt_root}: starting a new run at step 0{afresh}")
    say(f"device: {describe_device(cfg, env)}")
    data: RunData = prepare_run_data(cfg, env)  # raises DataError before anything is built
    say(f"data: {describe_data(cfg, data)}")

    seed_everything(tr.seed, env, cuda_graphs=tr.cuda_graphs)
    run_state = MoERunState()  # what the model's MoE layers share: metrics, deferred weight grads, exchanges
    # each layer's weights from its number: the same at any pipeline layout; only while this run's
    # model is built (a later model in the same process is not seeded by this run)
    set_layer_init_seed(tr.seed)
    try:
        # one chunk per virtual pipeline stage (one without the interleaved schedule)
        model = build_model_chunks(cfg, vocab_size=data.vocab_size, on_cuda=env.on_cuda, run_state=run_state)
    finally:
        set_layer_init_seed(None)
    say(f"model: {describe_model(model, cfg, env.device)}")
    model = wrap_for_training(model, tr.use_distributed_optimizer)
    optimizer = build_optimizer(cfg, model, env.on_cuda)
    scheduler = build_scheduler(cfg, optimizer)

    progress = Progress(world_size=env.world_size)
    if resume and latest is not None:
        progress = load_checkpoint(checkpoint_dir(ckpt_root, latest), model, optimizer, scheduler)
        progress.world_size = env.world_size
    elif cfg.checkpoint.load:
        load_checkpoint(Path(cfg.checkpoint.load), model)
    elif cfg.checkpoint.upcycle_from:
        from megatron_dmoe.training.upcycle import upcycle_dense_checkpoint

        upcycle_dense_checkpoint(cfg, model, optimizer)
    dist.barrier()  # every rank has loaded before the run directory changes
    if env.is_main:
        write_run_config(cfg, run_dir, overwrite, software_versions())
    dist.barrier()

    num_micro = _num_micro_batches(cfg)
    train_data = run_loader(cfg, data.train, progress.consumed_samples)
    tokens_per_step = tr.global_batch_size * cfg.model.seq_length
    flops_per_token = model_flops_per_token(cfg, vocab_size=padded_vocab_size(data.vocab_size, cfg))
    logger = MetricsLogger(
        run_dir,
        enabled=env.is_main,
        tensorboard=cfg.logging.tensorboard,
        progress_bar=cfg.logging.progress_bar,
        total_steps=tr.train_iters,
        start_step=progress.iteration,
    )
    if progress.iteration:
        logger.message(f"resumed from {checkpoint_dir(ckpt_root, progress.iteration)}")
    first_step = progress.iteration + 1  # logged whatever the interval: a sign of life in seconds
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
        logger.message(f"training: steps {first_step} to {tr.train_iters}, {tokens_per_step} tokens per step, "
                       f"a log line after step {first_step}, then every {every} step{'s' if every > 1 else ''}")
    watcher = PreemptionWatcher(env.device)
    result = TrainResult(run_dir=run_dir, iteration=progress.iteration)
    moe_metrics = run_state.metrics
    moe_metrics.megatron_tracker = False  # this loop logs the sums itself
    for chunk in model:
        chunk.train()
    window_start, window_steps = time.perf_counter(), 0
    window_loss = torch.zeros((), device=env.device)  # summed on the device: no per-step sync
    try:
        while progress.iteration < tr.train_iters and not out_of_time:
            step_start = time.perf_counter()
            loss, grad_norm, applied = train_step(model, optimizer, train_data, num_micro, env.device, run_state,
                                                  cfg.moe.expert_wgrad_per_step)
            if applied:
                scheduler.step(1)
                if cfg.moe.router_enable_expert_bias:
                    update_expert_biases(model)
            progress.iteration += 1
            progress.consumed_samples += tr.global_batch_size
            window_steps += 1
            window_loss += loss
            step = progress.iteration
            # the first step logs too: a sign of life within seconds of the start
            log_due = step % cfg.logging.log_interval == 0 or step == tr.train_iters or step == first_step
            if log_due and env.on_cuda:
                torch.cuda.synchronize()
            progress.train_time_s += time.perf_counter() - step_start
            out_of_time = time_limit_reached(progress.train_time_s, tr.time_limit_minutes, env.device)
            last = step == tr.train_iters or out_of_time

            logger.advance(step)
            values = None
            if log_due or last:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_steps * tokens_per_step / elapsed
                tflops = flops_per_token * tokens_per_s / env.world_size / 1e12
                values = {
                    "loss": mean_over_data_parallel(window_loss / window_steps),  # mean over the window
                    "lr": optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "tflops_per_gpu": tflops,
                    "mfu": tflops / cfg.logging.peak_tflops if cfg.logging.peak_tflops else None,
                    "skipped_update": not applied,
                    # the peak of memory allocated on this GPU so far (captured graphs' pools included)
                    "peak_memory_gib": torch.cuda.max_memory_allocated(env.device) / 2**30 if env.on_cuda else None,
                }
                values.update(moe_log_values(over_pipeline(moe_metrics.snapshot(group=ps.get_data_parallel_group()))))
                moe_metrics.reset()
                result.losses.append(values["loss"])
                window_start, window_steps = time.perf_counter(), 0
                window_loss.zero_()
            if tr.eval_interval and (step % tr.eval_interval == 0 or last):
                values = values or {}
                with run_loader(cfg, data.valid, 0) as valid:
                    values["val_loss"] = evaluate(model, valid, tr.eval_iters, num_micro, env.device)
                result.val_loss, result.val_step = values["val_loss"], step
                window_start = time.perf_counter()  # evaluation time is not training throughput
            if values is not None:
                values["train_time_s"] = progress.train_time_s  # seconds of training steps so far
                values["tokens"] = progress.consumed_samples * cfg.model.seq_length
                logger.log(step, values)

            stop_signal = watcher.should_stop()
            interval = cfg.checkpoint.save_interval
            save_due = (interval and step % interval == 0) or ((last or stop_signal) and interval != 0)
            if save_due:
                path = save_checkpoint(ckpt_root, model, optimizer, scheduler, progress, cfg.checkpoint.keep_last)
                logger.message(f"saved checkpoint {path}")
                window_start = time.perf_counter()
            if stop_signal:
                if interval == 0:
                    logger.message(f"stopping at step {step} on {stop_signal}; no checkpoint saved "
                                   "(checkpoint.save_interval is 0)")
                else:
                    logger.message(f"stopping at step {step} on {stop_signal}; continue with: "
                                   f"dmoe-train --run-dir {run_dir} --resume")
                result.preempted = True
                result.stop_signal = stop_signal
                break
            if out_of_time:
                logger.message(f"stopping at step {step}: training.time_limit_minutes="
                               f"{tr.time_limit_minutes} spent ({progress.train_time_s / 60:.2f} "
                               "minutes of training steps)")
                break
    finally:
        train_data.close()
        watcher.close()
        logger.close()
    result.iteration = progress.iteration
    result.out_of_time = out_of_time
    if env.is_main and cfg.logging.plot and not result.preempted:
        from megatron_dmoe.training.plots import plot_expert_load, plot_runs

        plot_runs([run_dir], run_dir / "loss.png")
        if cfg.moe.num_experts > 0:
            plot_expert_load(run_dir, run_dir / "expert_load.png")
    return result
