"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU: Triton compiles ahead of
time with its bundled ptxas. In a subprocess, because the test session runs Triton in interpreter
mode, whose kernels cannot be compiled. The script prints one JSON line (its last), returned here."""
import json
import os
import subprocess
import sys

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (an H100's or H200's 227 KB)


def compile_for_hopper(script: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
