"""Tensor and expert layouts on two GPUs with their layers captured as CUDA graphs
(`training.cuda_graphs: true`): the captured run matches the eager one, losses within 1e-5 and grad
norms within 1e-4, as test_ep_nccl_graphs.py's tests (two_gpu_layouts.py). Pipeline layouts:
test_two_gpu_layouts_graphs_pp.py."""
import pytest

from two_gpu_layouts import GRAPH_LAYOUTS, check_captured_layout_matches_eager

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", GRAPH_LAYOUTS["tensor-expert"])
def test_two_gpu_layouts_with_layer_graphs_match_eager(tmp_path, corpus_cache, name):
    check_captured_layout_matches_eager(tmp_path, corpus_cache, name)
