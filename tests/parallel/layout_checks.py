"""Every parallel layout that validation accepts trains as one process does: run in every process
of a gloo group.

For a world size, the candidate layouts are all combinations of the parallel keys (tensor,
sequence, expert, expert-tensor, context, pipeline) for a dense model and an MoE model (a dense
first layer, then MoE). Validation decides which are accepted; each accepted one trains STEPS steps
through the training loop, in the same processes (megatron's groups are rebuilt per layout), with
the distributed optimizer wherever there is more than one data-parallel rank to shard over, and
logs its losses and grad norms, which the test compares with one process's (`train_one_process`).
Pipeline layouts train at 2 and 4 processes; at 8 (64 gloo groups per layout on two cores) they
are validated only, and the interleaved schedule is covered by test_pipeline_training. At 8, one
more run, PARAMETERS_CHECKED, trains and saves a checkpoint, for a comparison of every parameter.
"""
import itertools
import json
from pathlib import Path

from megatron_dmoe.config import Environment, find_problems, load_config, resolve
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.training.loop import train

CPU = Environment(cuda=False, transformer_engine=False, apex=False)
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
         "model.ffn_hidden_size=64", "moe.ffn_hidden_size=32", "moe.top_k=2", "training.micro_batch_size=2",
         "training.train_iters=1", "training.lr_warmup_iters=0", "training.eval_interval=0",
         "checkpoint.save_interval=0", "logging.log_interval=1", "logging.progress_bar=off",
         "logging.tensorboard=false", "logging.plot=false", "training.device=cpu", "data.num_workers=0"]
KINDS = {"dense": ["moe.num_experts=0"], "moe": ["moe.num_experts=4", "moe.first_dense_layers=1"]}
# key under parallel. -> (short name, values)
AXES = {
    "tensor_model_parallel_size": ("tp", (1, 2, 4, 8)),
    "sequence_parallel": ("sp", (False, True)),
    "expert_model_parallel_size": ("ep", (1, 2, 4, 8)),
    "expert_tensor_parallel_size": ("etp", (1, 2)),
    "context_parallel_size": ("cp", (1, 2)),
    "pipeline_model_parallel_size": ("pp", (1, 2)),
}
TRAINED_PIPELINES_UP_TO = 4  # world size
STEPS = 2  # the second step's loss shows the first update
# At 8 processes, PP 2 x TP 2 (with SP) x DP 2 with the distributed optimizer, experts over EP 2,
# saves its last step, whose parameters are compared with one process's. Its model has MoE layers on
# both stages, so both stages' expert optimizer state is compared (a stage without experts saves
# through compat/distopt_empty_step.py, checked in test_pipeline_training.py).
PARAMETERS_CHECKED = "moe-every-layer-tp2-sp1-ep2-etp1-cp1-pp2"
KINDS_ALSO = {"moe-every-layer": ["moe.num_experts=4", "moe.first_dense_layers=0"]}
PARAMETERS_CHECKED_LAYOUT = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                             "parallel.expert_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                             "training.use_distributed_optimizer=true", f"checkpoint.save_interval={STEPS}"]
PARAMETERS_CHECKED_BATCH = 4  # data-parallel 2: a micro-batch of 2 on each


def one_process_overrides(kind, global_batch_size, cache_dir):
    """The overrides a layout of `kind` at this global batch size trains with, in one process."""
    return MODEL + {**KINDS, **KINDS_ALSO}[kind] + [
        f"training.train_iters={STEPS}", f"training.global_batch_size={global_batch_size}",
        f"data.cache_dir={cache_dir}"]


def logged_steps(run_dir):
    """{"loss": [per step], "grad_norm": [per step]} from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    return {key: [r[key] for r in records] for key in ("loss", "grad_norm")}


def train_one_process(kind, global_batch_size, cache_dir, run_dir, save=False):
    """Train the one-process counterpart of a layout in this process; returns its logged steps.
    save: keep a checkpoint of the last step."""
    from megatron_dmoe.parallel.distributed import destroy_distributed

    overrides = one_process_overrides(kind, global_batch_size, cache_dir)
    overrides.append(f"checkpoint.save_interval={STEPS if save else 0}")
    env = init_distributed("cpu")
    try:
        train(resolve(load_config(None, overrides)), env, Path(run_dir), resume=False)
    finally:
        destroy_distributed()
    return logged_steps(run_dir)


def layouts(world_size, cache_dir):
    """(name, resolved config, problems) of every candidate layout at this world size."""
    out = []
    for kind, values in itertools.product(KINDS, itertools.product(*(v for _, v in AXES.values()))):
        layout = dict(zip(AXES, values))
        dp = world_size // (layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"]) or 1
        name = "-".join([kind] + [f"{AXES[k][0]}{int(v)}" for k, v in layout.items()])
        overrides = one_process_overrides(kind, 2 * dp, cache_dir) + [
            f"parallel.{k}={str(v).lower()}" for k, v in layout.items()] + [
            f"training.use_distributed_optimizer={str(dp > 1).lower()}"]
        cfg = resolve(load_config(None, overrides))
        out.append((name, cfg, find_problems(cfg, world_size, env=CPU)))
    return out


def train_accepted_layouts(run_root, cache_dir, summary_file, accepted):
    """Train STEPS steps of every accepted layout, `accepted` [(name, resolved config)] in the order
    `layouts` gives (validated once, in the test process: each rank would spend seconds on the
    hundreds of candidates); rank 0 writes a summary {trained: {name: {"loss": [per step],
    "grad_norm": [per step]}}} to `summary_file`."""
    import torch.distributed as dist

    world = dist.get_world_size()
    trained = {}
    for name, cfg in accepted:
        par = cfg.parallel
        if par.pipeline_model_parallel_size > 1 and world > TRAINED_PIPELINES_UP_TO:
            continue
        trained[name] = _train_layout(cfg, Path(run_root) / name)
    summary = {"trained": trained}
    if world == 8:
        overrides = one_process_overrides("moe-every-layer", PARAMETERS_CHECKED_BATCH, cache_dir)
        cfg = resolve(load_config(None, overrides + PARAMETERS_CHECKED_LAYOUT))
        assert not find_problems(cfg, world, env=CPU)
        summary[PARAMETERS_CHECKED] = _train_layout(cfg, Path(run_root) / PARAMETERS_CHECKED)
    if dist.get_rank() == 0:
        Path(summary_file).write_text(json.dumps(summary))


def _train_layout(cfg, run_dir):
    """Train `cfg` in this group with megatron's groups rebuilt for its layout; its logged steps on
    the main rank (None elsewhere)."""
    par = cfg.parallel
    env = init_distributed("cpu", par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                           par.expert_model_parallel_size, par.expert_tensor_parallel_size,
                           virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size)
    train(cfg, env, run_dir, resume=False)
    return logged_steps(run_dir) if env.is_main else None
