"""The package's barrier names this process's GPU under NCCL (torch otherwise guesses it from the
rank and prints a raw UserWarning and a C++ warning line at every call), and every barrier of the
package goes through it."""
from pathlib import Path

import torch.distributed as dist

from megatron_dmoe.parallel import distributed

PACKAGE = Path(distributed.__file__).resolve().parents[1]


def _calls(monkeypatch, backend):
    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.torch.cuda, "current_device", lambda: 3)
    return calls


def test_nccl_barrier_names_the_current_device(monkeypatch):
    calls = _calls(monkeypatch, "nccl")
    distributed.barrier(group="g")
    assert calls == [{"group": "g", "device_ids": [3]}]


def test_gloo_barrier_names_no_device(monkeypatch):
    calls = _calls(monkeypatch, "gloo")
    distributed.barrier()
    assert calls == [{"group": None}]


def test_every_barrier_of_the_package_goes_through_it():
    direct = [f"{path.relative_to(PACKAGE)}:{number}"
              for path in PACKAGE.rglob("*.py")
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if "dist.barrier(" in line and path.name != "distributed.py"]
    assert direct == [], f"use megatron_dmoe.parallel.distributed.barrier: {direct}"
