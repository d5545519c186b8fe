"""Loader worker processes ignore SIGTERM (preemption is the training process's to handle), so
they must be stopped by the loader itself: on close, and at exit when a loader was left open."""
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_dmoe.data.loader import build_loader


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        t = torch.full((4,), i)
        return {"tokens": t, "labels": t, "loss_mask": t.float(), "position_ids": t}


def test_close_stops_the_workers_and_the_loader():
    before = set(multiprocessing.active_children())
    with build_loader(Numbers(), 2, 0, 0, 1, num_workers=2, seed=1) as loader:
        assert next(loader)["tokens"][:, 0].tolist() == [0, 1]
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)
    loader.close()  # closing twice is harmless


def test_an_open_loader_does_not_hold_up_interpreter_exit(tmp_path):
    # The loader sits in a reference cycle, so only the exit path can stop its workers; before the
    # loader stopped them itself, multiprocessing's exit handler waited on them forever.
    script = tmp_path / "leave_open.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from megatron_dmoe.data.loader import build_loader
        from test_loader_shutdown import Numbers

        loader = build_loader(Numbers(), 2, 0, 0, 1, num_workers=2, seed=1)
        next(loader)
        cycle = [loader]
        cycle.append(cycle)
        print("trained")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "trained"
