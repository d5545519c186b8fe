"""Warnings no user can act on stay out of a run's output: megatron-core's calls of deprecated torch
collectives, its `.grad` reads of shard views, its CUDA advice on a CPU run, its router-dtype and
pad-token advice, Transformer Engine's weak-reference notice, torch's AccumulateGrad stream warning;
under torchrun only rank 0 shows warnings; each dmoe-* command names itself in its warnings, shown
once its checks have passed; dmoe-eval leaves out the config's warnings about training."""
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


def test_each_command_names_itself_and_held_warnings_wait_for_the_checks(monkeypatch, capsys):
    from megatron_dmoe.console import held_warnings, show_warnings_plainly

    monkeypatch.setattr(warnings, "showwarning", lambda *args, **kwargs: None)  # Python's own form: not here
    for prog in ("dmoe-import", "dmoe-eval", "dmoe-generate"):
        show_warnings_plainly(prog)
        warnings.warn(ConfigWarning("training.seed", f"from {prog}"))
    assert capsys.readouterr().err.splitlines() == [
        f"{prog}: warning: training.seed: from {prog}" for prog in ("dmoe-import", "dmoe-eval", "dmoe-generate")]
    with held_warnings():
        warnings.warn(ConfigWarning("training.seed", "after the checks"))
        assert capsys.readouterr().err == ""
    assert capsys.readouterr().err == "dmoe-generate: warning: training.seed: after the checks\n"
    with held_warnings() as held:
        warnings.warn(ConfigWarning("training.seed", "before a refusal"))
        held.show = False
    with pytest.raises(RuntimeError), held_warnings():
        warnings.warn(ConfigWarning("training.seed", "before an error"))
        raise RuntimeError
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("message", [
    "Using a large number of experts (e.g. >=32) without fp32 routing. Consider enabling moe_router_dtype for "
    "better numerical stability.",
    "The pad token id in the tokenizer collides with another special token id. This may cause instability and lack "
    "of covergence during training. As such, the training flow will avoid masking out any pad tokens already present "
    "in the dataset. If you would like to disable this behavior, please provide a tokenizer with a uniquely-defined "
    "pad token id.",
    "The AccumulateGrad node's stream does not match the stream of the node that produced the incoming gradient. "
    "This may incur unnecessary synchronization and break CUDA graph capture.",
])
def test_megatron_cores_and_torchs_advice_that_does_not_apply_is_dropped(message):
    assert _shown(True, message, UserWarning) == []


def test_the_pad_token_warning_that_asks_for_a_decision_stays():
    kept = ("The pad token id in the tokenizer collides with another special token id. This may cause instability "
            "and lack of covergence during training. Do not ignore this warning if you do not understand the "
            "implications. ")
    assert _shown(True, kept, UserWarning) == [kept]


def test_the_notice_about_transformer_engines_weak_references_is_dropped(caplog):
    import logging

    quiet_unactionable_warnings(True)
    graphs = logging.getLogger("megatron.core.transformer.cuda_graphs")
    with caplog.at_level(logging.WARNING, logger=graphs.name):
        graphs.warning("Transformer Engine was not detected while capturing training cudagraphs.As a result ...")
        graphs.warning("Creating 4 CUDA graphs")
    assert [r.getMessage() for r in caplog.records] == ["Creating 4 CUDA graphs"]
