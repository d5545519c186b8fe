"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU: Triton compiles ahead of
time with its bundled ptxas. In a subprocess, because the test session runs Triton in interpreter
mode, whose kernels cannot be compiled. The script prints one JSON line (its last), returned here.
spill_bytes assembles a kernel's PTX with ptxas -v to read its register spills (Triton's metadata
has them only once loaded on a GPU)."""
import json
import os
import re
import subprocess
import sys
import tempfile

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (an H100's or H200's 227 KB)


def compile_for_hopper(script: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ptxas() -> str:
    from triton.backends.nvidia import compiler

    try:
        tool = compiler.get_ptxas(90)  # newer Triton: per architecture
    except TypeError:
        tool = compiler.get_ptxas()
    return tool.path


def spill_bytes(ptx: str) -> int:
    """Bytes of register spill stores ptxas reports for the PTX (every kernel in it), for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    try:
        done = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", fh.name, "-o", os.devnull], capture_output=True,
                              text=True, timeout=300)
    finally:
        os.unlink(fh.name)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = re.findall(r"(\d+) bytes spill stores", done.stderr)
    assert counts, done.stderr[-3000:]
    return sum(int(c) for c in counts)
