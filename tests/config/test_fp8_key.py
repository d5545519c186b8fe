"""training.fp8: one problem, before anything is built, naming what to use instead: on CPU, on GPUs
before Hopper, without bf16, and (while the model's layers do not run fp8) everywhere else."""
import pytest
import torch

from megatron_dmoe.config import Environment, find_problems, schema
from megatron_dmoe.config.section_checks import fp8 as fp8_check

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


def test_on_hopper_it_needs_bf16_and_layers_that_use_it(monkeypatch):
    assert "set training.bf16: true" in _problems(_gpu((9, 0)), fp8="blockwise")[0][1]
    [(_, message)] = _problems(_gpu((9, 0)), fp8="blockwise", bf16=True)
    assert "is not used by the model's layers in this version" in message
    monkeypatch.setattr(fp8_check, "LAYERS_USE_FP8", True)
    assert _problems(_gpu((9, 0)), fp8="blockwise", bf16=True) == []
    assert _problems(_gpu((10, 0)), fp8="blockwise", bf16=True) == []
    assert _problems(_gpu(None), fp8="blockwise", bf16=True) == []  # capability unknown: not refused


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
