"""Kernel tests run on CUDA when there is a GPU, else on CPU tensors through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton)."""
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    import triton.language as tl

    if type(tl.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "triton was imported without its interpreter; run the tests from the repository root "
            "(tests/conftest.py sets TRITON_INTERPRET=1) or set TRITON_INTERPRET=1 yourself"
        )


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def seeded_by_name(request):
    """torch's generator seeded from the test's own name; the seed is printed, so a failure's report
    shows it (captured output) and the draw can be repeated."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")
