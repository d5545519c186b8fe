"""tools/bench_wgrad_window.py runs its tiny shapes on CPU (Triton's interpreter, the pointer
epilogue) and writes its rows; the TMA reduce epilogue's own check is gpu-marked
(test_wgrad_window.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_wgrad_window.py"


@pytest.mark.slow
def test_bench_wgrad_window_toy_writes_its_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_wgrad_window", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "window.json"
    assert bench.main(["--toy", "--configs", "16x16x2x4x1,32x8x2x4x2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["equal"] is True
    names = [r["epilogue"] for r in result["rows"]]
    assert names[:2] == ["pointers", "pointers, tiles in expert order"]
    assert [n.split()[0] for n in names[2:]] == ["pointers"] * 2 + ["torch.bmm"]
    # the expert-order row sums the same bit for bit, the configs' within rounding
    assert [r.get("agrees") for r in result["rows"][1:4]] == [True, True, True]
    assert all(r["ms"] > 0 for r in result["rows"])
    assert "epilogues equal bit for bit: True" in capsys.readouterr().out
