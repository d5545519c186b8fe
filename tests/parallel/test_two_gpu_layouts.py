"""Megatron's parallel layouts on two GPUs in fp32 (two_gpu_layouts.py): 20 steps of a small dMoE
at the same global batch and seed give one GPU's per-step losses and grad norms within 1e-4, for
tensor parallelism with sequence parallelism, pipeline parallelism (also interleaved), expert
parallelism with the distributed optimizer, and experts split by expert tensor parallelism. bf16:
test_two_gpu_layouts_bf16.py; captured layers: test_two_gpu_layouts_graphs.py."""
import pytest

from two_gpu_layouts import check_layouts_train_like_one_gpu

pytestmark = pytest.mark.gpu


def test_two_gpu_layouts_train_like_one_gpu_fp32(tmp_path, corpus_cache):
    check_layouts_train_like_one_gpu(tmp_path, corpus_cache, "fp32")
