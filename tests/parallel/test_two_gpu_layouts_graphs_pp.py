"""Pipeline layouts on two GPUs (PP 2, and with 2 virtual stages) with their layers captured as
CUDA graphs: the captured run matches the eager one, as test_two_gpu_layouts_graphs.py's."""
import pytest

from two_gpu_layouts import GRAPH_LAYOUTS, check_captured_layout_matches_eager

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", GRAPH_LAYOUTS["pipeline"])
def test_two_gpu_pipeline_layouts_with_layer_graphs_match_eager(tmp_path, corpus_cache, name):
    check_captured_layout_matches_eager(tmp_path, corpus_cache, name)
