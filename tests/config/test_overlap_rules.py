"""parallel.overlap_grad_reduce / overlap_param_gather: `true` refused where overlapping is not
correct (captured layers, deferred expert weight gradients; the gather without the distributed
optimizer or without the overlapped reduction, as Megatron-LM), and `auto` resolved at start-up: on
for CUDA runs whose gradients cross ranks, off on CPU and where `true` is refused (with a note)."""
import pytest

from megatron_dmoe.config import ConfigError, Environment, find_problems, resolve, validate
from megatron_dmoe.config.overlap_rules import resolve_overlap

GPU = Environment(cuda=True, transformer_engine=False, apex=False)
GRAD, PARAM = "parallel.overlap_grad_reduce", "parallel.overlap_param_gather"


@pytest.mark.parametrize("changes, key, fragment", [
    ({GRAD: True, "training.cuda_graphs": True, "moe.backend": "sparse"}, GRAD, "captured layers"),
    ({GRAD: True, "moe.expert_wgrad_per_step": True, "moe.backend": "sparse"}, GRAD, "expert_wgrad_per_step"),
    ({GRAD: True, "moe.expert_wgrad_window": 2, "moe.backend": "sparse"}, GRAD, "expert_wgrad_window"),
    ({GRAD: True, PARAM: True}, PARAM, "training.use_distributed_optimizer: true"),
    ({GRAD: "auto", PARAM: True, "training.use_distributed_optimizer": True}, PARAM, "--overlap-grad-reduce"),
    ({GRAD: False, "parallel.ddp_bucket_size": 1000}, "parallel.ddp_bucket_size", "only when"),
    ({GRAD: "yes"}, GRAD, "use one of: auto, true, false"),
    ({"parallel.ddp_bucket_size": 0}, "parallel.ddp_bucket_size", "out of range"),
])
def test_refusals_name_the_key_and_the_fix(make, changes, key, fragment):
    problems = find_problems(make(changes), world_size=2, env=GPU)
    assert any(k == key and fragment in m for k, m in problems), problems


def test_overlap_on_request_validates(make):
    validate(make({GRAD: True, PARAM: True, "training.use_distributed_optimizer": True,
                   "parallel.ddp_bucket_size": 5000}), world_size=2, env=GPU)
    with pytest.raises(ConfigError):
        validate(make({GRAD: False, PARAM: True, "training.use_distributed_optimizer": True}), world_size=2, env=GPU)


@pytest.mark.parametrize("changes, cuda, world, local, grad, param, note", [
    ({}, True, 2, 1, True, False, None),  # two hosts
    ({"training.use_distributed_optimizer": True}, True, 2, 1, True, True, None),
    ({}, True, 2, 2, False, False, None),  # one host: off, quietly
    ({}, True, 4, None, False, False, None),  # no host count given: one host
    ({}, True, 1, 1, False, False, None),  # nothing crosses ranks: no note
    ({"parallel.expert_model_parallel_size": 2}, True, 2, 1, True, False, None),  # dense DP 2
    ({"parallel.tensor_model_parallel_size": 2, "moe.num_experts": 0}, True, 2, 1, False, False, None),
    ({}, False, 2, 1, False, False, None),  # CPU: off, quietly
    ({"training.cuda_graphs": True}, True, 2, 1, False, False, "captured layers"),
    ({"moe.expert_wgrad_per_step": True}, True, 2, 1, False, False, "expert_wgrad_per_step"),
    ({GRAD: False, "training.use_distributed_optimizer": True}, True, 2, 1, False, False, None),
])
def test_auto_resolves_once(make, changes, cuda, world, local, grad, param, note):
    cfg = resolve(make({"training.cuda_graphs": False, **changes}))
    out, notes = resolve_overlap(cfg, cuda=cuda, world_size=world, local_world_size=local)
    assert (out.parallel.overlap_grad_reduce, out.parallel.overlap_param_gather) == (grad, param)
    assert cfg.parallel.overlap_grad_reduce == changes.get(GRAD, "auto")  # the caller's config is kept
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0] and notes[0].startswith(f"note: {GRAD}: auto")


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({}, 16),  # neither launcher says: one host
])
def test_ranks_per_host_reads_the_launcher(monkeypatch, env, expected):
    from megatron_dmoe.parallel.distributed import ranks_per_host

    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ranks_per_host(16) == expected
