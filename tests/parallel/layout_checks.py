"""Every parallel layout that validation accepts trains as one process does: run in every process
of a gloo group.

The candidates at a world size come from the run configuration's own parallel section: every key
of its schema (a new key joins without an edit here), each boolean both ways, each size every
number from 1 to the world size (None too where the key allows it), for a dense and an MoE model
(a dense first layer, then MoE). Of those, only combinations where megatron's two splits of the
world hold are layouts at all (world = TP x CP x PP x data = ETP x EP x PP x expert data,
WORLD_SPLITS); `test_layout_space` checks that validation refuses a sample of the rest. Validation
decides which candidates are accepted: the layout rules it runs (parallel/layout_rules.py, pure
functions) refuse most of them in microseconds, and what they refuse the validator refuses too;
the rest go through `find_problems`. Each accepted layout trains STEPS steps through the training
loop in the same processes (megatron's groups are rebuilt per layout), with the distributed
optimizer wherever there is more than one data-parallel rank to shard over, a micro-batch per
data-parallel and pipeline rank (the interleaved schedule needs a multiple of the pipeline size),
and logs its losses and grad norms, which the test compares with one process's
(`train_one_process`). At 2 and 4 processes every accepted layout trains; at 8 (64 gloo groups per
pipeline layout on two cores) a sample that has every value of every key that some accepted
layout has (`covering_sample`, a seeded draw), and one more run, PARAMETERS_CHECKED, which trains
and saves a checkpoint for a comparison of every parameter.
"""
import dataclasses
import itertools
import json
import random
import typing
from pathlib import Path

from megatron_dmoe.config import Environment, find_problems, load_config, resolve
from megatron_dmoe.config.schema import ParallelConfig
from megatron_dmoe.config.section_checks.parallel import LAYOUT_KEYS
from megatron_dmoe.parallel import layout_rules
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.parallel.layout_rules import CP_KEY, EP_KEY, ETP_KEY, PP_KEY, SP_KEY, TP_KEY, VPP_KEY
from megatron_dmoe.training.loop import train

CPU = Environment(cuda=False, transformer_engine=False, apex=False)
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
         "model.ffn_hidden_size=64", "moe.ffn_hidden_size=32", "moe.top_k=2", "training.micro_batch_size=2",
         "training.train_iters=1", "training.lr_warmup_iters=0", "training.eval_interval=0",
         "checkpoint.save_interval=0", "logging.log_interval=1", "logging.progress_bar=off",
         "logging.tensorboard=false", "logging.plot=false", "training.device=cpu", "data.num_workers=0"]
MICRO_BATCH = 2
KINDS = {"dense": ["moe.num_experts=0"], "moe": ["moe.num_experts=4", "moe.first_dense_layers=1"]}
# megatron's two splits of the world into process groups (parallel_state): the sizes of each
# multiply to a divisor of the world size
WORLD_SPLITS = ((TP_KEY, CP_KEY, PP_KEY), (ETP_KEY, EP_KEY, PP_KEY))
# short names in layout names; a key without one is named by its field
SHORT = {TP_KEY: "tp", PP_KEY: "pp", VPP_KEY: "vpp", EP_KEY: "ep", ETP_KEY: "etp", SP_KEY: "sp", CP_KEY: "cp"}
STEPS = 2  # the second step's loss shows the first update
# Accepted layouts that do not train: (key, value) -> (what their processes raise, why). They are
# left out of the training runs, and test_layouts trains one of each in a test of its own that
# expects the failure: the entry goes once its layouts train or validation refuses them.
KNOWN_FAILURES = {}  # a virtual pipeline size of 1 was one until config.resolve made it None
# At 8 processes, PP 2 x TP 2 (with SP) x DP 2 with the distributed optimizer, experts over EP 2,
# saves its last step, whose parameters are compared with one process's. Its model has MoE layers on
# both stages, so both stages' expert optimizer state is compared (a stage without experts saves
# through compat/distopt_empty_step.py, checked in test_pipeline_training.py).
PARAMETERS_CHECKED = "moe-every-layer-tp2-pp2-ep2-etp1-sp1-cp1"
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


# Keys of the parallel section that say how gradients travel, not how the model splits: each is
# trained against its own reference elsewhere (tests/parallel/test_overlap_grad_reduce.py).
NOT_LAYOUT = {"parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.ddp_bucket_size"}


def parallel_space(world_size):
    """{key: candidate values} for every key of the parallel section but NOT_LAYOUT, from its
    schema's types."""
    hints = typing.get_type_hints(ParallelConfig)
    sizes = tuple(range(1, world_size + 1))
    space = {}
    for field in dataclasses.fields(ParallelConfig):
        kind = hints[field.name]
        key = f"parallel.{field.name}"
        if key in NOT_LAYOUT:
            continue
        if kind is bool:
            space[key] = (False, True)
        elif kind is int:
            space[key] = sizes
        elif kind == typing.Optional[int]:
            space[key] = (None,) + sizes
        else:
            raise AssertionError(f"{key}: no candidate values for its type {kind}; add them to parallel_space")
    return space


def is_layout(values, world_size):
    """Whether megatron's splits of the world (WORLD_SPLITS) hold for these parallel sizes."""
    for split in WORLD_SPLITS:
        product = 1
        for key in split:
            product *= values[key]
        if world_size % product:
            return False
    return True


def layout_name(kind, values):
    """`kind-tp2-pp1-...`: each key's short name and value (a key at None left out)."""
    parts = [f"{SHORT.get(key, key.split('.')[-1])}{int(value)}" for key, value in values.items() if value is not None]
    return "-".join([kind] + parts)


def _override(key, value):
    return f"{key}={'null' if value is None else str(value).lower()}"


def _data_parallel(values, world_size):
    """The data-parallel size (1 where the sizes leave no whole one: the batch stays valid)."""
    return max(world_size // (values[TP_KEY] * values[CP_KEY] * values[PP_KEY]), 1)


def candidate_overrides(kind, values, world_size, cache_dir):
    """The overrides of a candidate layout: a micro-batch per data-parallel and pipeline rank."""
    dp = _data_parallel(values, world_size)
    return one_process_overrides(kind, MICRO_BATCH * dp * values[PP_KEY], cache_dir) + [
        _override(key, value) for key, value in values.items()] + [
        f"training.use_distributed_optimizer={str(dp > 1).lower()}"]


def _rule_values(base, values, world_size):
    """What the validator hands the layout rules for this candidate (config/section_checks/parallel.py)."""
    out = {}
    for key in LAYOUT_KEYS:
        section, name = key.split(".")
        out[key] = getattr(getattr(base, section), name)
    out.update(values)
    out["training.global_batch_size"] = MICRO_BATCH * _data_parallel(values, world_size) * values[PP_KEY]
    return out


def layouts(world_size, cache_dir):
    """(accepted, refused, space): accepted {name: (kind, parallel values, resolved config)} and
    refused {name: problems} of every candidate at this world size, the space they came from."""
    space = parallel_space(world_size)
    accepted, refused = {}, {}
    for kind in KINDS:
        base = resolve(load_config(None, one_process_overrides(kind, MICRO_BATCH, cache_dir)))
        for combination in itertools.product(*space.values()):
            values = dict(zip(space, combination))
            if not is_layout(values, world_size):
                continue
            name = layout_name(kind, values)
            # the rules as the validator runs them; has_dense_mlp=False leaves out one of their
            # refusals, never adds one
            rule_values = _rule_values(base, values, world_size)
            problems = (layout_rules.model_split_problems(rule_values, has_dense_mlp=False)
                        + layout_rules.world_size_problems(rule_values, world_size))
            if not problems:
                cfg = resolve(load_config(None, candidate_overrides(kind, values, world_size, cache_dir)))
                problems = find_problems(cfg, world_size, env=CPU)
            if problems:
                refused[name] = problems
            else:
                accepted[name] = (kind, values, cfg)
    return accepted, refused, space


def known_failure(values):
    """The (key, value) of KNOWN_FAILURES this layout has, or None."""
    return next((entry for entry in KNOWN_FAILURES if values.get(entry[0]) == entry[1]), None)


def covering_sample(accepted, seed):
    """Names of accepted layouts, in an order drawn with `seed`, each kept if it has a kind or a
    key's value that no layout kept before it has: together they have every value any accepted
    layout has."""
    names = sorted(accepted)
    random.Random(seed).shuffle(names)
    covered, sample = set(), []
    for name in names:
        kind, values, _ = accepted[name]
        pairs = {("kind", kind), *values.items()}
        if pairs - covered:
            sample.append(name)
            covered |= pairs
    return sample


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


def train_layouts(run_root, cache_dir, summary_file, chosen, parameters_checked):
    """Train STEPS steps of each of `chosen` [(name, resolved config)] (validated once, in the test
    process: each rank would spend seconds on the candidates), then PARAMETERS_CHECKED where
    `parameters_checked`; rank 0 writes a summary {trained: {name: {"loss": [per step],
    "grad_norm": [per step]}}} to `summary_file`."""
    import torch.distributed as dist

    trained = {name: _train_layout(cfg, Path(run_root) / name) for name, cfg in chosen}
    summary = {"trained": trained}
    if parameters_checked:
        overrides = one_process_overrides("moe-every-layer", PARAMETERS_CHECKED_BATCH, cache_dir)
        cfg = resolve(load_config(None, overrides + PARAMETERS_CHECKED_LAYOUT))
        assert not find_problems(cfg, dist.get_world_size(), env=CPU)
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
