"""megatron_dmoe.compat.mcore and the patches of megatron-core internals it locates, on whichever
supported megatron-core is installed (CI runs the suite at 0.16 and at 0.19)."""
import logging
from importlib import metadata

from mcore_compat_checks import patched_internals
from megatron_dmoe.compat import mcore
from process_group import run_in_processes


def test_installed_release_is_in_the_supported_range():
    installed = tuple(int(p) for p in metadata.version("megatron-core").split(".")[:2])
    assert mcore.version() == installed
    assert mcore.SUPPORTED[0] <= installed <= mcore.SUPPORTED[1]


def test_the_patch_targets_exist_on_this_release():
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.pipeline_parallel import schedules

    assert mcore.checkpoint_writer_homes() and mcore.checkpoint_finalize_homes()
    assert callable(schedules.create_cudagraphs)  # compat/schedule_capture.py swaps it
    assert callable(getattr(filesystem_async, mcore.write_results_queue_name()))


def test_release_notices_are_dropped_and_other_messages_kept(caplog):
    mcore.quiet_notices()
    mcore.quiet_notices()  # idempotent: one filter per logger
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING):
        logger.warning("GPTModel IS DEPRECATED. use HybridModel")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_cpu_grad_sync_and_in_process_checkpoint_writer():
    run_in_processes(1, patched_internals, timeout=240)


def test_a_checkpoint_in_the_newer_format_is_refused_in_one_line_by_older_releases(tmp_path, monkeypatch):
    (tmp_path / "metadata.json").write_text("{}")
    monkeypatch.setattr(mcore, "version", lambda: (0, 16))
    problem = mcore.checkpoint_format_problem(tmp_path)
    assert problem and "\n" not in problem
    assert str(tmp_path) in problem and "megatron-core 0.16 cannot read" in problem and "0.19" in problem
    (tmp_path / "common.pt").write_bytes(b"")  # 0.16's own format
    assert mcore.checkpoint_format_problem(tmp_path) is None
    (tmp_path / "common.pt").unlink()
    monkeypatch.setattr(mcore, "version", lambda: (0, 19))  # reads both formats
    assert mcore.checkpoint_format_problem(tmp_path) is None
