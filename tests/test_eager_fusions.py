"""compat/eager_fusions.py: where torch has no CUDA, a process that imports megatron_dmoe before
megatron-core gets megatron-core's fusions uncompiled (at 0.16 it then never imports torch's
inductor; 0.19's router compiles a function of its own, which still imports it)."""
import subprocess
import sys

import pytest
import torch

CHECK = """
import sys
import megatron_dmoe.training.loop
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_gelu
from megatron_dmoe.compat.mcore import version
print(jit.jit_fuser is jit.noop_decorator, type(fused_bias_gelu.bias_gelu).__name__,
      version() >= (0, 19) or "torch._inductor" not in sys.modules)
"""

PLAIN = """
import sys
import megatron.core.jit as jit
import megatron_dmoe
print(jit.jit_fuser is jit.noop_decorator, "torch._inductor" in sys.modules)
"""


def _run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA megatron-core's fusions are compiled as upstream does")
def test_without_cuda_the_fusions_are_plain_functions_and_inductor_stays_out():
    assert _run(CHECK) == ["True", "function", "True"]


def test_megatron_core_imported_first_keeps_its_own_fuser():
    # the switch acts only at megatron-core's first import, from megatron_dmoe's
    assert _run(PLAIN) == ["False", "True"]
