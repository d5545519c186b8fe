"""moe.expert_wgrad_window: auto (the default), decided at start-up: the largest window of
AUTO_WINDOWS that divides the step's micro-batches and whose memory estimate fits, else 1 with a note;
1 wherever the experts take no window. The estimate is arithmetic, so GPU sizes are given, not needed."""
import pytest

from megatron_dmoe.config import ConfigError, load_config, resolve, validate
from megatron_dmoe.training import memory_estimate as me
from megatron_dmoe.training.wgrad_window_auto import AUTO_WINDOWS, resolve_wgrad_window

H200 = 150_754_820_096  # total_memory of an H200, as torch reports it
H100_80GB = 85_031_714_816
VOCAB = 32000


def _cfg(config=None, *overrides):
    return resolve(load_config(config, list(overrides)))


def _with(cfg, window):
    return _cfg("zoo/dmoe_small", f"moe.expert_wgrad_window={window}", *_overrides_of(cfg))


def _overrides_of(cfg):
    return [f"training.micro_batch_size={cfg.training.micro_batch_size}",
            f"training.global_batch_size={cfg.training.global_batch_size}",
            f"moe.first_dense_layers={cfg.moe.first_dense_layers}"]


def test_default_is_auto():
    assert _cfg().moe.expert_wgrad_window == "auto"


def test_the_largest_window_that_fits_is_taken():
    cfg = _cfg("zoo/dmoe_small")  # 16 micro-batches a step
    resolved, notes = resolve_wgrad_window(cfg, True, 1, VOCAB, H200)
    assert resolved.moe.expert_wgrad_window == AUTO_WINDOWS[0] == 8 and notes == []
    assert cfg.moe.expert_wgrad_window == "auto"  # the caller's config is not changed
    # with every layer MoE the 8-window does not fit an H200 under 90 %, the 4-window does
    all_moe = _cfg("zoo/dmoe_small", "moe.first_dense_layers=0")
    limit = 0.9 * H200
    eight = me.estimate_memory(_with(all_moe, 8), VOCAB, 1, on_cuda=True).total
    four = me.estimate_memory(_with(all_moe, 4), VOCAB, 1, on_cuda=True).total
    assert four <= limit < eight
    assert resolve_wgrad_window(all_moe, True, 1, VOCAB, H200)[0].moe.expert_wgrad_window == 4
    # on the 80 GB card the 4-window does not fit under 90 %, the 2-window does
    limit = 0.9 * H100_80GB
    four = me.estimate_memory(_with(cfg, 4), VOCAB, 1, on_cuda=True).total
    two = me.estimate_memory(_with(cfg, 2), VOCAB, 1, on_cuda=True).total
    assert two <= limit < four
    assert resolve_wgrad_window(cfg, True, 1, VOCAB, H100_80GB)[0].moe.expert_wgrad_window == 2


def test_no_window_fits_gives_one_and_a_note():
    cfg = _cfg("zoo/dmoe_small")
    resolved, notes = resolve_wgrad_window(cfg, True, 1, VOCAB, 64 * 2**30)
    assert resolved.moe.expert_wgrad_window == 1
    assert len(notes) == 1 and "moe.expert_wgrad_window: auto" in notes[0]
    assert "a window of 2 would need" in notes[0] and "moe.expert_wgrad_window=2 forces it" in notes[0]
    # training.memory_check's share is the limit (here 50 % of an H200 leaves no room either)
    halved = _cfg("zoo/dmoe_small", "training.memory_check=0.4")
    assert resolve_wgrad_window(halved, True, 1, VOCAB, H200)[0].moe.expert_wgrad_window == 1


def test_only_windows_that_divide_the_step():
    six = _cfg("zoo/dmoe_small", "training.global_batch_size=192")  # 6 micro-batches of 32
    assert resolve_wgrad_window(six, True, 1, VOCAB, H200)[0].moe.expert_wgrad_window == 2
    odd = _cfg("zoo/dmoe_small", "training.global_batch_size=96")  # 3
    assert resolve_wgrad_window(odd, True, 1, VOCAB, H200)[0].moe.expert_wgrad_window == 1
    # data parallelism divides the micro-batches: 16 over 4 ranks leaves 4 each
    dp4 = _cfg("zoo/dmoe_small", "parallel.expert_model_parallel_size=4")
    assert me.micro_batches_per_step(dp4, 4) == 4
    assert resolve_wgrad_window(dp4, True, 4, VOCAB, H200)[0].moe.expert_wgrad_window == 4  # 8 does not divide 4
    dp8 = _cfg("zoo/dmoe_small", "training.global_batch_size=256")  # 8 micro-batches; over 8 ranks: 1
    assert resolve_wgrad_window(dp8, True, 8, VOCAB, H200)[0].moe.expert_wgrad_window == 1


@pytest.mark.parametrize("overrides", [
    ("moe.num_experts=0",),                       # no experts
    ("moe.backend=grouped",),                     # not the sparse experts
    ("moe.expert_wgrad_per_step=true", "training.cuda_graphs=false"),  # deferred over the step instead
])
def test_runs_without_windows_get_one_silently(overrides):
    cfg = _cfg("zoo/dmoe_small", *overrides)
    resolved, notes = resolve_wgrad_window(cfg, True, 1, VOCAB, H200)
    assert resolved.moe.expert_wgrad_window == 1 and notes == []


def test_cpu_gets_one_and_a_number_is_kept():
    cfg = _cfg("zoo/dmoe_small")
    assert resolve_wgrad_window(cfg, False, 1, VOCAB, 0)[0].moe.expert_wgrad_window == 1
    two = _cfg("zoo/dmoe_small", "moe.expert_wgrad_window=2")
    assert resolve_wgrad_window(two, True, 1, VOCAB, 64 * 2**30) == (two, [])


def test_the_key_takes_auto_or_a_whole_number():
    validate(_cfg(None, "moe.expert_wgrad_window=auto"))
    validate(_cfg(None, "moe.expert_wgrad_window=2", "moe.backend=sparse"))
    for bad, words in (("big", "use auto or a whole number >= 1"), ("0", ">= 1")):
        with pytest.raises(ConfigError) as err:
            validate(_cfg(None, f"moe.expert_wgrad_window={bad}"))
        assert "moe.expert_wgrad_window" in str(err.value) and words in str(err.value)


def test_unresolved_auto_is_estimated_as_one():
    cfg = _cfg("zoo/dmoe_small")
    assert me.estimate_memory(cfg, VOCAB, on_cuda=True) == me.estimate_memory(_with(cfg, 1), VOCAB, on_cuda=True)


def test_asked_for_overlap_takes_no_window_and_auto_overlap_declines_one():
    from megatron_dmoe.config.overlap_rules import resolve_overlap

    asked = _cfg("zoo/dmoe_small", "parallel.overlap_grad_reduce=true")
    resolved, notes = resolve_wgrad_window(asked, True, 1, VOCAB, H200)
    assert resolved.moe.expert_wgrad_window == 1 and "parallel.overlap_grad_reduce: true" in notes[0]
    # auto overlap is decided after the window: with the window auto took, it stays off (2 ranks)
    windowed, _ = resolve_wgrad_window(_cfg("zoo/dmoe_small", "parallel.expert_model_parallel_size=2"),
                                       True, 2, VOCAB, H200)
    assert windowed.moe.expert_wgrad_window == 8
    overlapped, overlap_notes = resolve_overlap(_with_graphs_off(windowed), True, 2, local_world_size=1)
    assert overlapped.parallel.overlap_grad_reduce is False and "moe.expert_wgrad_window" in overlap_notes[0]
    # an unresolved auto window is no refusal of its own
    plain, _ = resolve_overlap(_with_graphs_off(_cfg("zoo/dmoe_small", "parallel.expert_model_parallel_size=2")),
                               True, 2, local_world_size=1)  # two hosts
    assert plain.parallel.overlap_grad_reduce is True


def _with_graphs_off(cfg):
    import copy

    out = copy.deepcopy(cfg)
    out.training.cuda_graphs = False
    return out
