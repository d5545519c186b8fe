"""Nothing that validates fails later: every parallel layout validation accepts for a dense and an
MoE model at 2, 4 and 8 CPU processes trains a step (layout_checks; one spawned group per world
size), experts split over expert-tensor-parallel ranks included, and the layouts it refuses include
every context-parallel one."""
import json

import pytest

from layout_checks import TRAINED_PIPELINES_UP_TO, layouts, train_accepted_layouts
from process_group import run_in_processes


# 8 processes on two cores take about 3 minutes alone
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_accepted_layout_trains_a_step(tmp_path, corpus_cache, world_size):
    summary = tmp_path / "summary.json"
    run_in_processes(world_size, train_accepted_layouts, str(tmp_path / "runs"), corpus_cache, str(summary),
                     timeout=1400)
    result = json.loads(summary.read_text())
    candidates = layouts(world_size, corpus_cache)
    accepted = [name for name, _, problems in candidates if not problems]
    assert result["accepted"] == accepted and result["refused"] == len(candidates) - len(accepted)
    assert not any("-cp2-" in name for name in accepted), accepted
    assert not any(name.startswith("dense") and "-etp2-" in name for name in accepted), accepted
    expected = [name for name in accepted if world_size <= TRAINED_PIPELINES_UP_TO or name.endswith("-pp1")]
    assert sorted(result["trained"]) == sorted(expected), (result["trained"], expected)
    # layouts composed of every supported axis are among them
    assert f"moe-tp2-sp1-ep{world_size}-etp1-cp1-pp1" in expected
    assert f"moe-tp2-sp1-ep{world_size // 2}-etp2-cp1-pp1" in expected
    if world_size == 4:
        assert "moe-tp2-sp1-ep2-etp1-cp1-pp2" in expected
        assert "moe-tp2-sp1-ep1-etp2-cp1-pp2" in expected
