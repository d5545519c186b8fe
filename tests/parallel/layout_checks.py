"""Every parallel layout that validation accepts trains: run in every process of a gloo group.

For a world size, the candidate layouts are all combinations of the parallel keys (tensor,
sequence, expert, expert-tensor, context, pipeline) for a dense model and an MoE model (a dense
first layer, then MoE). Validation decides which are accepted; each accepted one trains one step
through the training loop, in the same processes (megatron's groups are rebuilt per layout), with
the distributed optimizer wherever there is more than one data-parallel rank to shard over.
Pipeline layouts train at 2 and 4 processes; at 8 (64 gloo groups per layout on two cores) they are
validated only, and the interleaved schedule is covered by test_pipeline_training.
"""
import itertools
import json
import math
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


def layouts(world_size, cache_dir):
    """(name, resolved config, problems) of every candidate layout at this world size."""
    out = []
    for kind, values in itertools.product(KINDS, itertools.product(*(v for _, v in AXES.values()))):
        layout = dict(zip(AXES, values))
        dp = world_size // (layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"]) or 1
        overrides = MODEL + KINDS[kind] + [f"parallel.{k}={str(v).lower()}" for k, v in layout.items()] + [
            f"training.global_batch_size={2 * dp}", f"data.cache_dir={cache_dir}",
            f"training.use_distributed_optimizer={str(dp > 1).lower()}"]
        cfg = resolve(load_config(None, overrides))
        name = "-".join([kind] + [f"{AXES[k][0]}{int(v)}" for k, v in layout.items()])
        out.append((name, cfg, find_problems(cfg, world_size, env=CPU)))
    return out


def train_accepted_layouts(run_root, cache_dir, summary_file):
    """Train one step of every accepted layout; rank 0 writes a summary {accepted: [names],
    trained: {name: loss}, refused: count} to `summary_file`."""
    import torch.distributed as dist

    world = dist.get_world_size()
    trained, accepted, refused = {}, [], 0
    for name, cfg, problems in layouts(world, cache_dir):
        if problems:
            refused += 1
            continue
        accepted.append(name)
        par = cfg.parallel
        if par.pipeline_model_parallel_size > 1 and world > TRAINED_PIPELINES_UP_TO:
            continue
        env = init_distributed("cpu", par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                               par.expert_model_parallel_size, par.expert_tensor_parallel_size,
                               virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size)
        run_dir = Path(run_root) / name
        train(cfg, env, run_dir, resume=False)
        if env.is_main:
            record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
            assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]), (name, record)
            trained[name] = record["loss"]
    if dist.get_rank() == 0:
        Path(summary_file).write_text(json.dumps({"accepted": accepted, "trained": trained, "refused": refused}))
