"""test_two_gpu_layouts.py's layouts in bf16 against one GPU in bf16, within 2e-2 (two_gpu_layouts.py)."""
import pytest

from two_gpu_layouts import check_layouts_train_like_one_gpu

pytestmark = pytest.mark.gpu


def test_two_gpu_layouts_train_like_one_gpu_bf16(tmp_path, corpus_cache):
    check_layouts_train_like_one_gpu(tmp_path, corpus_cache, "bf16")
