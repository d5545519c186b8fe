"""A checkpoint write that fails for space or permissions says so in one line, naming the path and
the free space; the last complete checkpoint stays `latest` and nothing else is lost."""
import errno
import functools
import re
import shutil

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async

from train_helpers import small_args, snapshot

FAILURES = {
    "disk_full": (lambda: OSError(errno.ENOSPC, "No space left on device"), "no space left"),
    # what torch's zip writer raised on a real full disk
    "short_write": (lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                    "a file could not be written in full"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_save_keeps_the_last_checkpoint_and_says_why(cli_run, tmp_path, corpus_cache, monkeypatch, failure):
    make_error, reason = FAILURES[failure]
    run = tmp_path / "run"
    write_item = filesystem_async._write_item
    seen = {}

    @functools.wraps(write_item)  # megatron reads its signature
    def write_until_step_2(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "name") and hasattr(a, "write"))
        if "iter_0000002" in str(stream.name):
            if "before" not in seen:  # the run directory as the failing save found it
                seen["before"] = {k: v for k, v in snapshot(run).items() if ".tmp" not in k}
            stream.write(b"partial")
            raise make_error()
        return write_item(*args, **kwargs)

    monkeypatch.setattr(filesystem_async, "_write_item", write_until_step_2)
    result = cli_run(run, *small_args(corpus_cache, 3, "checkpoint.save_interval=1"))

    assert result.returncode == 2
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    staging = run / "checkpoints" / "iter_0000002.tmp"
    assert f"to {staging}: {reason}" in message
    number, unit = re.search(r"\(([\d.]+) (GiB|MiB|KiB) free there\)", message).groups()
    reported = float(number) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
    assert reported == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.05)
    assert f"{run / 'checkpoints' / 'iter_0000001'} stays latest" in message
    assert (run / "checkpoints" / "latest").read_text() == "1"
    assert snapshot(run) == seen["before"]  # no staging left behind, nothing changed


def test_permission_and_other_errors_are_told_apart():
    from megatron_dmoe.training.write_errors import write_failure

    assert "no permission" in write_failure(PermissionError(errno.EACCES, "Permission denied"))
    assert "no permission" in write_failure(OSError(errno.EROFS, "Read-only file system"))
    wrapped = RuntimeError("Worker failure")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert "no space" in write_failure(wrapped)
    assert write_failure(ValueError("a bug")) is None
