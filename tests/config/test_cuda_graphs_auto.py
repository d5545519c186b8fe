"""training.cuda_graphs: auto (the default) resolves to true where `true` validates, else to false
with one note naming the reason; true and false pass through; bad values are refused."""
import pytest

from megatron_dmoe.config import ConfigError, Environment, RunConfig, find_problems, resolve, validate
from megatron_dmoe.model.cuda_graphs_auto import resolve_cuda_graphs

EVERYTHING = Environment(cuda=True, transformer_engine=True, apex=True)

# (changes to tiny, fragment of the note, or None when auto turns graphs on)
CASES = {
    "plain_bf16": ({"training.bf16": True}, None),
    "fp32_grouped": ({"moe.backend": "grouped"}, None),
    "dense": ({"moe.num_experts": 0}, None),
    "capacity": ({"moe.expert_capacity_factor": 1.0}, None),
    "symmetric_ep": ({"parallel.expert_model_parallel_size": 2, "training.bf16": True}, None),
    "cpu_device": ({"training.device": "cpu"}, "training.device is cpu"),
    "nccl": ({"parallel.expert_model_parallel_size": 2, "moe.ep_exchange": "nccl"}, "NCCL expert-parallel exchange"),
    "nvshmem": ({"parallel.expert_model_parallel_size": 2, "moe.ep_exchange": "nvshmem", "training.bf16": True}, None),
    "pipeline": ({"parallel.pipeline_model_parallel_size": 2}, None),
    "full_recompute": ({"training.recompute_granularity": "full"}, "activation recompute"),
    # SDPA's own checkpoint (model/attention.py); with Transformer Engine installed, impl auto takes
    # its attention, recomputed by megatron's reentrant checkpoint (EVERYTHING below has it)
    "selective_recompute": ({"training.recompute_granularity": "selective", "model.transformer_impl": "local"}, None),
    "selective_recompute_dropout": ({"training.recompute_granularity": "selective", "model.transformer_impl": "local",
                                     "model.attention_dropout": 0.1}, "model.attention_dropout = 0.1"),
    "selective_recompute_te": ({"training.recompute_granularity": "selective",
                                "model.transformer_impl": "transformer_engine"}, "reentrant checkpoint"),
    "interleaved_pipeline": ({"parallel.pipeline_model_parallel_size": 2, "model.num_layers": 4,
                              "parallel.virtual_pipeline_model_parallel_size": 2}, None),
    "reference": ({"moe.backend": "reference"}, "moe.backend: reference"),
    "wgrad_per_step": ({"moe.expert_wgrad_per_step": True, "moe.backend": "sparse"}, "expert_wgrad_per_step"),
    "auto_backend_falls_to_reference": ({"moe.ffn_hidden_size": 200}, "auto picks the reference experts"),
    "tensor_parallel": ({"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True}, None),
    "dense_tensor_parallel": ({"moe.num_experts": 0, "parallel.tensor_model_parallel_size": 2}, None),
    "expert_tensor_parallel": ({"parallel.expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size = 2"),
}
# auto leaves these eager although `true` validates there
AUTO_ONLY = ("wgrad_per_step", "auto_backend_falls_to_reference", "expert_tensor_parallel")


@pytest.mark.parametrize("name", list(CASES))
def test_auto_matches_what_true_allows(make, monkeypatch, name):
    changes, fragment = CASES[name]
    # a GPU whose torch.nn.functional.grouped_mm does not run (probing it needs CUDA): a width the
    # sparse kernels cannot take leaves only the reference experts to backend: auto
    monkeypatch.setattr("megatron_dmoe.moe.experts.grouped._runs_on", lambda device_type, dtype: False)
    cfg = resolve(make({**changes, "training.cuda_graphs": "auto"}))
    out, notes = resolve_cuda_graphs(cfg, cuda=True, world_size=2, local_world_size=2)
    assert cfg.training.cuda_graphs == "auto"  # the caller's config is not changed
    assert out.training.cuda_graphs is (fragment is None)
    if fragment is None or name == "cpu_device":  # a run without CUDA misses nothing: no note
        assert notes == []
    else:
        assert len(notes) == 1 and fragment in notes[0] and "training.cuda_graphs=false" in notes[0]
    # wherever auto does not capture for a reason `true` has too, `true` is refused; where it
    # captures, `true` validates
    strict = resolve(make({**changes, "training.cuda_graphs": True}))
    keys = [k for k, _ in find_problems(strict, world_size=2, env=EVERYTHING)]
    if fragment is None:
        assert keys == []
    elif name in AUTO_ONLY:
        assert "training.cuda_graphs" not in keys
    else:
        assert "training.cuda_graphs" in keys


def test_without_cuda_auto_is_off_without_a_note(make):
    out, notes = resolve_cuda_graphs(resolve(make()), cuda=False, world_size=1)
    assert out.training.cuda_graphs is False and notes == []


def test_across_hosts_auto_exchange_is_nccl(make):
    cfg = resolve(make({"parallel.expert_model_parallel_size": 2}))
    out, notes = resolve_cuda_graphs(cfg, cuda=True, world_size=16, local_world_size=8)
    assert out.training.cuda_graphs is False and "spans hosts" in notes[0] and "NCCL" in notes[0]


def test_across_hosts_nvshmem_exchange_is_captured(make):
    """moe.ep_exchange: nvshmem keeps its split sizes on the device, so a run across hosts captures."""
    cfg = resolve(make({"parallel.expert_model_parallel_size": 2, "moe.ep_exchange": "nvshmem",
                        "training.bf16": True}))
    out, notes = resolve_cuda_graphs(cfg, cuda=True, world_size=16, local_world_size=8)
    assert out.training.cuda_graphs is True and notes == []


@pytest.mark.parametrize("value", [True, False])
def test_explicit_values_pass_through(make, value):
    cfg = resolve(make({"training.cuda_graphs": value, "training.device": "cpu"}))
    out, notes = resolve_cuda_graphs(cfg, cuda=False, world_size=1)
    assert out is cfg and notes == []


def test_auto_is_the_default():
    assert RunConfig().training.cuda_graphs == "auto"


@pytest.mark.parametrize("value, fragment", [
    ("on", "'on' is not allowed; use one of: auto, true, false"),
    (1, "expected true or false or a string, got 1"),
])
def test_bad_values_are_refused(make, value, fragment):
    with pytest.raises(ConfigError) as info:
        validate(make({"training.cuda_graphs": value}), env=EVERYTHING)
    assert info.value.problems == [("training.cuda_graphs", fragment)]
