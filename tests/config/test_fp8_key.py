"""training.fp8: one problem, before anything is built, naming what to use instead: on CPU, on GPUs
before Hopper, without bf16, and with the layouts that have no fp8 path; accepted on Hopper
otherwise, and from Megatron-LM's --fp8-format e4m3 --fp8-recipe blockwise."""
import pytest
import torch

from megatron_dmoe.config import Environment, find_problems, schema

CPU = Environment(cuda=False, transformer_engine=False, apex=False)


def _gpu(capability):
    return Environment(cuda=True, transformer_engine=False, apex=False, cuda_capability=capability)


def _problems(env, **training):
    cfg = schema.RunConfig()
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return [p for p in find_problems(cfg, env=env) if p[0] == "training.fp8"]


def test_refused_on_cpu():
    assert _problems(CPU, fp8="blockwise") == [(
        "training.fp8", "blockwise needs a GPU with fp8 tensor cores (Hopper, compute capability 9.0, or "
        "newer) and this run is on CPU; set training.fp8: null (CPU runs train in fp32)")]
    # a GPU machine running on its CPU too
    assert "this run is on CPU" in _problems(_gpu((9, 0)), fp8="blockwise", device="cpu", bf16=False)[0][1]


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_refused_before_hopper(capability):
    [(_, message)] = _problems(_gpu(capability), fp8="blockwise", bf16=True)
    assert message == (f"blockwise needs fp8 tensor cores (compute capability 9.0, Hopper, or newer); this "
                       f"GPU has {capability[0]}.{capability[1]}; set training.fp8: null and training.bf16: true")


def test_on_hopper_it_needs_bf16_and_runs():
    assert "set training.bf16: true" in _problems(_gpu((9, 0)), fp8="blockwise")[0][1]
    assert _problems(_gpu((9, 0)), fp8="blockwise", bf16=True) == []
    assert _problems(_gpu((10, 0)), fp8="blockwise", bf16=True) == []
    assert _problems(_gpu(None), fp8="blockwise", bf16=True) == []  # capability unknown: not refused


def _layout_problems(*overrides):
    from megatron_dmoe.config import load_config, resolve

    cfg = resolve(load_config(None, ["training.fp8=blockwise", "training.bf16=true", *overrides]))
    return [p for p in find_problems(cfg, world_size=2, env=_gpu((9, 0)))
            if "fp8" in p[0] or "fp8" in p[1]]


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.tensor_model_parallel_size=2"], "runs unsharded linears only; parallel.tensor_model_parallel_size"),
    (["model.multi_latent_attention=true"], "no fp8 path for multi-latent attention"),
    (["model.transformer_impl=transformer_engine"], "this package's own fp8 (no Transformer Engine)"),
    (["moe.block_size=16"], "needs moe.block_size 32 or more"),
    (["moe.backend=grouped"], "which moe.backend: grouped does not have"),
    (["moe.expert_capacity_factor=1.0"], "the token-dropping baseline"),
], ids=["tp2", "mla", "te", "block16", "grouped", "capacity"])
def test_layouts_without_an_fp8_path_are_refused_in_one_line(overrides, expected):
    problems = _layout_problems(*overrides)
    assert len(problems) == 1 and expected in problems[0][1], problems


def test_the_default_dmoe_run_takes_fp8_on_two_gpus():
    assert _layout_problems() == []


def test_megatron_lm_s_fp8_flags():
    from megatron_dmoe.config.megatron_names import flags_to_overrides

    _, overrides, problems, _ = flags_to_overrides(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], [])
    assert problems == [] and overrides == ["training.fp8=blockwise"]
    for flags, fix in ((["--fp8-format", "hybrid"], "use --fp8-format e4m3 --fp8-recipe blockwise"),
                       (["--fp8-recipe", "delayed"], "use --fp8-recipe blockwise")):
        _, _, problems, _ = flags_to_overrides(flags, [])
        assert len(problems) == 1 and fix in problems[0], problems


def test_null_is_never_refused_and_other_values_are():
    for env in (CPU, _gpu((8, 0)), _gpu((9, 0))):
        assert _problems(env) == []
    assert _problems(_gpu((9, 0)), fp8="e4m3", bf16=True) == [
        ("training.fp8", "'e4m3' is not allowed; use one of: null, blockwise")]


def test_only_a_detected_environment_probes_the_gpu():
    assert _gpu(None).gpu_capability() is None  # an Environment passed in is taken as it is
    detected = Environment.detect()
    expected = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    assert detected.gpu_capability() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal, on a machine without CUDA")
def test_dmoe_train_refuses_in_one_line_on_cpu(cli_run):
    result = cli_run(None, "training.fp8=blockwise")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "dmoe-train: error: invalid configuration: training.fp8: blockwise needs a GPU with fp8 tensor cores "
        "(Hopper, compute capability 9.0, or newer) and this run is on CPU; set training.fp8: null (CPU runs "
        "train in fp32)")
