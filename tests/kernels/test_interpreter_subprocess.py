"""Reruns this folder's CPU tests in a fresh process when the interpreter is out of reach here.

See conftest.py: in a whole-suite run triton may be imported (without TRITON_INTERPRET) before this
folder is collected. The subprocess sets the variable before anything imports triton.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_kernel_suite_in_subprocess(needs_subprocess):
    if not needs_subprocess:
        pytest.skip("the interpreter runs in this process: the kernel tests ran here")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
        cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
