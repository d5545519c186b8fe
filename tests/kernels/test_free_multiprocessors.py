"""leave_multiprocessors_free: persistent kernels' grids shrink by the multiprocessors left free
while it is active, never below one multiprocessor, and come back after (the count of a CUDA
device stubbed, so that this runs anywhere)."""
import pytest
import torch

from dmoe_kernels import launch


def test_grids_leave_the_asked_multiprocessors_free_and_come_back(monkeypatch):
    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert launch.persistent_programs(gpu, 2) == 264
    with launch.leave_multiprocessors_free(16):
        assert launch.persistent_programs(gpu, 2) == 232
        with launch.leave_multiprocessors_free(500):
            assert launch.persistent_programs(gpu, 3) == 3  # one multiprocessor at least
        assert launch.persistent_programs(gpu, 1) == 116
    assert launch.persistent_programs(gpu, 2) == 264
    with pytest.raises(RuntimeError), launch.leave_multiprocessors_free(8):
        raise RuntimeError("an error inside restores the grid")
    assert launch.persistent_programs(gpu, 1) == 132
    with pytest.raises(ValueError, match="count must be >= 0"):
        with launch.leave_multiprocessors_free(-1):
            pass
