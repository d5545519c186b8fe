"""Warnings no user can act on stay out of a run's output: megatron-core's calls of deprecated torch
collectives, its `.grad` reads of shard views, its CUDA advice on a CPU run; under torchrun only rank
0 shows warnings; dmoe-eval leaves out the config's warnings about training."""
import warnings

import pytest

from megatron_dmoe.compat.quiet_warnings import quiet_unactionable_warnings
from megatron_dmoe.config import ConfigWarning, load_config, resolve

SEQUENCE_PARALLEL_ADVICE = ("When using sequence parallelism it is recommended to set the environment variable "
                            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
UNACTIONABLE = [
    ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` "
     "instead.", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
     "`torch.distributed.reduce_scatter_single` instead.", FutureWarning),
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute won't be "
     "populated during autograd.backward().", UserWarning),
]


def _shown(on_cuda, message, category):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_unactionable_warnings(on_cuda)
        warnings.warn(message, category)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("message, category", UNACTIONABLE)
def test_unactionable_warnings_are_dropped(message, category):
    assert _shown(False, message, category) == []
    assert _shown(True, message, category) == []


def test_cuda_advice_is_dropped_only_without_cuda():
    assert _shown(False, SEQUENCE_PARALLEL_ADVICE, UserWarning) == []
    assert _shown(True, SEQUENCE_PARALLEL_ADVICE, UserWarning) == [SEQUENCE_PARALLEL_ADVICE]
    assert _shown(False, "something else", UserWarning) == ["something else"]


def test_only_rank_0_shows_warnings(monkeypatch, capsys):
    from megatron_dmoe.console import show_warnings_plainly

    passed_on = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: passed_on.append(str(message)))
    show_warnings_plainly("dmoe-train")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        warnings.showwarning(UserWarning(f"from rank {rank}"), UserWarning, "x.py", 1)
        warnings.showwarning(ConfigWarning("training.seed", f"seen by rank {rank}"), ConfigWarning, "x.py", 1)
    assert [m for m in passed_on if m.startswith("from rank")] == ["from rank 0"]
    assert capsys.readouterr().err == "dmoe-train: warning: training.seed: seen by rank 0\n"


def test_inference_leaves_out_the_warnings_about_training():
    from megatron_dmoe.inference.run_model import check_inference_config

    cfg = resolve(load_config(None, ["training.train_iters=2", "training.lr_warmup_iters=4"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        check_inference_config(cfg)
