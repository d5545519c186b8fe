"""Kernel tests run on CUDA when there is a GPU, else on CPU tensors through Triton's interpreter.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET=1 must be set
before triton is first imported. When this folder runs alone that is done here. In a whole-suite
run another folder may already have imported triton (megatron-core does): the interpreter is then
out of reach in this process, so this folder's tests are skipped here and run again, unchanged, in
a subprocess that sets the variable first (test_interpreter_subprocess.py).
"""
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
RUNNER = "test_interpreter_subprocess.py"

if torch.cuda.is_available():
    INTERPRETER_IN_PROCESS = False
    NEEDS_SUBPROCESS = False
else:
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl

    INTERPRETER_IN_PROCESS = type(tl.cdiv).__name__ == "InterpretedFunction"
    NEEDS_SUBPROCESS = not INTERPRETER_IN_PROCESS


def pytest_collection_modifyitems(config, items):
    if not NEEDS_SUBPROCESS:
        return
    skip = pytest.mark.skip(reason="triton was imported without its interpreter; rerun in a subprocess")
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.parent == HERE and path.name != RUNNER:
            item.add_marker(skip)


@pytest.fixture
def needs_subprocess():
    return NEEDS_SUBPROCESS


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
