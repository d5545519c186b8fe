"""The legal parallel layouts: how tensor (TP), pipeline (PP, and its virtual stages VPP), expert (EP),
expert-tensor (ETP), context (CP) and data parallelism may split a model and a world of processes.

Pure functions over plain values, with no import at all (no torch, no megatron-core, nothing of ours):
the run configuration's check (config/section_checks/parallel.py) reports them before anything is
built, under the configuration's keys, and the parallel code (expert_layout.py) shares
`ffn_shards_per_expert`.

`values` maps a configuration key (`parallel.tensor_model_parallel_size`, `model.num_layers`, ...) to its
value after defaults are derived; a key whose own value is invalid is left out, and every rule that reads
it is skipped (its problem is reported once, where the value is checked).
"""
from __future__ import annotations

TP_KEY = "parallel.tensor_model_parallel_size"
PP_KEY = "parallel.pipeline_model_parallel_size"
EP_KEY = "parallel.expert_model_parallel_size"
ETP_KEY = "parallel.expert_tensor_parallel_size"
CP_KEY = "parallel.context_parallel_size"
SP_KEY = "parallel.sequence_parallel"
VPP_KEY = "parallel.virtual_pipeline_model_parallel_size"
WINDOW_KEY = "moe.expert_wgrad_window"


def divisors(n: int) -> str:
    """The divisors of n, listed for a message."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def ffn_shards_per_expert(num_experts: int, expert_parallel: int, expert_tensor_parallel: int = 1) -> int:
    """Ranks each expert's FFN is split over: the expert-tensor-parallel size, times the expert-
    parallel ranks per expert when there are more of those than experts."""
    extra = expert_parallel // num_experts if num_experts and expert_parallel > num_experts else 1
    return expert_tensor_parallel * extra


def model_split_problems(values: dict, *, has_dense_mlp: bool) -> list:
    """(key, message) for each way the model's shapes do not split over the parallel sizes: heads
    and query groups over TP, layers over PP (and its virtual stages), experts over EP and ETP,
    sequence parallelism; context parallelism is refused. has_dense_mlp: whether any layer has
    megatron's dense MLP (model.ffn_hidden_size, split over TP)."""
    problems = []
    have = _have(values)
    if have(TP_KEY, "model.num_attention_heads"):
        tp, heads = values[TP_KEY], values["model.num_attention_heads"]
        if heads % tp:
            problems.append(("model.num_attention_heads", f"{heads} is not divisible by {TP_KEY} "
                             f"({tp}); use a tensor-parallel size among: {divisors(heads)}"))
        if have("model.num_query_groups") and values["model.num_query_groups"] != heads \
                and values["model.num_query_groups"] % tp:
            groups = values["model.num_query_groups"]
            problems.append(("model.num_query_groups", f"{groups} is not divisible by {TP_KEY} "
                             f"({tp}); use a tensor-parallel size among: {divisors(groups)}"))
    if have(PP_KEY, "model.num_layers") and values["model.num_layers"] % values[PP_KEY]:
        layers, pp = values["model.num_layers"], values[PP_KEY]
        problems.append(("model.num_layers", f"{layers} is not divisible by {PP_KEY} ({pp}); use "
                         f"a multiple of {pp}"))
    elif have(PP_KEY, VPP_KEY, "model.num_layers") and values[VPP_KEY] is not None:
        problems += _virtual_pipeline_problems(values[PP_KEY], values[VPP_KEY], values["model.num_layers"])
    if have(EP_KEY, ETP_KEY, "moe.num_experts") and values[EP_KEY] * values[ETP_KEY] > 1:
        ep, etp, experts = values[EP_KEY], values[ETP_KEY], values["moe.num_experts"]
        if experts == 0:
            key = EP_KEY if ep > 1 else ETP_KEY
            problems.append((key, f"{values[key]} needs MoE layers, but moe.num_experts is 0; set "
                             f"moe.num_experts or use 1"))
        elif experts % ep and ep % experts:
            problems.append(("moe.num_experts", f"{experts} is not divisible by {EP_KEY} ({ep}), "
                             f"nor is {ep} a multiple of it; use a multiple of {ep} (each rank "
                             f"holds whole experts) or one of {divisors(ep)} (each expert's FFN "
                             f"is split over several ranks)"))
        else:
            problems += _expert_layout_problems(values, ep, etp, experts)
    problems += _tensor_parallel_problems(values, has_dense_mlp)
    if have(CP_KEY) and values[CP_KEY] != 1:
        problems.append((CP_KEY, f"{values[CP_KEY]}: context parallelism is not supported; use 1"))
    return problems


def world_size_problems(values: dict, world_size) -> list:
    """(key, message) for each way the parallel sizes and batch sizes do not fit `world_size`
    processes (None: not known, only the batch sizes are checked against each other): world =
    tensor x pipeline x data, the experts laid over the same ranks, and the global batch made of
    whole micro-batches on every data-parallel rank."""
    problems = []
    have = _have(values)
    micro_key, global_key = "training.micro_batch_size", "training.global_batch_size"
    world = world_size
    if world is not None and (type(world) is not int or world < 1):
        problems.append(("world_size", f"{world!r} is not a number of processes; use an "
                                       f"integer >= 1"))
        world = None
    data_parallel = None
    if world is not None and have(TP_KEY, PP_KEY):
        tp, pp = values[TP_KEY], values[PP_KEY]
        model_parallel = tp * pp
        if world % model_parallel:
            problems.append((TP_KEY, f"tensor ({tp}) x pipeline ({pp}) parallel size "
                             f"{model_parallel} does not divide the world size {world}; use sizes "
                             f"whose product divides {world} (world = tensor x pipeline x data)"))
        else:
            data_parallel = world // model_parallel
        # megatron-core lays the experts out over the same ranks: world = expert-tensor x expert
        # x pipeline x expert-data, so EP may fold over tensor- and data-parallel ranks alike
        if have(EP_KEY, ETP_KEY):
            ep, etp = values[EP_KEY], values[ETP_KEY]
            expert_space = world // pp if world % pp == 0 else None
            if expert_space is not None and expert_space % (ep * etp):
                split = f" x {ETP_KEY} ({etp})" if etp > 1 else ""
                allowed = divisors(expert_space // etp) if expert_space % etp == 0 else "1"
                problems.append((EP_KEY, f"{ep}{split} does not divide the {expert_space} ranks of a "
                                 f"pipeline stage (world size {world} / pipeline {pp}; expert "
                                 f"parallelism folds over tensor- and data-parallel ranks); use one "
                                 f"of: {allowed}"))
    if not have(micro_key, global_key):
        return problems
    micro, total = values[micro_key], values[global_key]
    if data_parallel is not None:
        step = micro * data_parallel
        if total % step:
            problems.append((global_key, f"{total} is not divisible by {micro_key} ({micro}) x "
                             f"data-parallel size ({data_parallel}) = {step}; use a multiple of "
                             f"{step}"))
        elif have(PP_KEY, VPP_KEY) and values[VPP_KEY] is not None and (total // step) % values[PP_KEY]:
            # megatron's interleaved schedule runs the micro-batches in groups of the pipeline size
            pp = values[PP_KEY]
            problems.append((global_key, f"{total} gives {total // step} micro-batches per step "
                             f"(/ ({micro_key} {micro} x data-parallel size {data_parallel})), which "
                             f"the interleaved schedule ({VPP_KEY} {values[VPP_KEY]}) needs to be a "
                             f"multiple of {PP_KEY} ({pp}); use a multiple of {step * pp}"))
        elif (have(WINDOW_KEY) and values[WINDOW_KEY] != "auto" and values[WINDOW_KEY] > 1
              and values.get("moe.num_experts", 0) > 0
              and (total // step) % values[WINDOW_KEY]):
            # a window's gradients reach main_grad when it is full: a step must end with a full one
            window = values[WINDOW_KEY]
            problems.append((WINDOW_KEY, f"{window} does not divide the {total // step} micro-batches of a step "
                             f"({global_key} {total} / ({micro_key} {micro} x data-parallel size "
                             f"{data_parallel})); use one of: {divisors(total // step)}"))
    elif total % micro:
        problems.append((global_key, f"{total} is not divisible by {micro_key} ({micro}); use a "
                         f"multiple of {micro}"))
    return problems


def _have(values: dict):
    return lambda *keys: all(key in values for key in keys)


def _expert_layout_problems(values: dict, ep: int, etp: int, experts: int) -> list:
    """A valid expert layout: the ffn shards (expert-tensor parallelism, and more expert-parallel
    ranks than experts) divide the expert's width, and no token-dropping baseline (it runs on whole
    local experts only)."""
    problems = []
    shards = ffn_shards_per_expert(experts, ep, etp)
    if shards > 1 and "moe.ffn_hidden_size" in values:
        width = values["moe.ffn_hidden_size"]
        if width % shards:
            split = [f"{ETP_KEY} {etp}"] if etp > 1 else []
            if ep > experts:
                split.append(f"{EP_KEY} {ep} / moe.num_experts {experts}")
            problems.append(("moe.ffn_hidden_size", f"{width} is not divisible by {shards}, the "
                             f"number of ranks each expert's FFN is split over "
                             f"({' x '.join(split)}); use a multiple of {shards}"))
    capacity_key = "moe.expert_capacity_factor"
    if capacity_key in values and values[capacity_key] is not None:
        key, size = (EP_KEY, ep) if ep > 1 else (ETP_KEY, etp)
        problems.append((capacity_key, f"{_number(values[capacity_key])} (the token-dropping "
                         f"baseline) runs on whole local experts, but {key} is {size}; set "
                         f"it to null (dropless) or {key} to 1"))
    return problems


def _virtual_pipeline_problems(pp: int, vpp: int, layers: int) -> list:
    """The interleaved schedule: several model chunks per pipeline rank, each with whole layers."""
    if pp == 1:
        return [(VPP_KEY, f"{vpp} needs {PP_KEY} > 1 (it splits each pipeline rank's layers "
                 f"into chunks); set it to null or raise {PP_KEY}")]
    if layers % (pp * vpp):
        return [(VPP_KEY, f"{vpp} x {PP_KEY} ({pp}) = {pp * vpp} model chunks do not divide "
                 f"model.num_layers ({layers}); use a value whose product with {pp} divides "
                 f"{layers}, or null")]
    return []


def _tensor_parallel_problems(values: dict, has_dense_mlp: bool) -> list:
    """What tensor (and sequence) parallelism needs of the model's shapes."""
    if TP_KEY not in values or SP_KEY not in values:
        return []
    problems = []
    tp, sp = values[TP_KEY], values[SP_KEY]
    if sp and tp == 1:
        problems.append((SP_KEY, f"true needs {TP_KEY} > 1; set it to false"))
    if tp == 1:
        return problems
    if not sp and values.get("moe.num_experts", 0) > 0:
        problems.append((SP_KEY, f"false with MoE layers and {TP_KEY} {tp}: every tensor-parallel rank "
                         f"would route the same tokens through experts replicated over them; set it to "
                         f"true (each rank then routes its own sequence shard)"))
    if sp and "model.seq_length" in values and values["model.seq_length"] % tp:
        problems.append(("model.seq_length", f"{values['model.seq_length']} is not divisible by {TP_KEY} "
                         f"({tp}), which sequence parallelism needs; use a multiple of {tp}"))
    if "model.ffn_hidden_size" in values and has_dense_mlp and values["model.ffn_hidden_size"] % tp:
        problems.append(("model.ffn_hidden_size", f"{values['model.ffn_hidden_size']} is not divisible by "
                         f"{TP_KEY} ({tp}) (the dense MLPs are split over the tensor-parallel ranks); "
                         f"use a multiple of {tp}"))
    return problems


def _number(value) -> str:
    """A number as the configuration's messages write it (1, 1.0, 1.5: Python's repr; true, false
    and null never reach the rules, whose keys' types are checked first)."""
    return repr(value)
