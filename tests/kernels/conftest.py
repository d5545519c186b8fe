"""Kernel tests run on CUDA when there is a GPU, else on CPU tensors through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton)."""
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
