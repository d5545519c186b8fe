"""tools/bench_epilogues.py runs its tiny cases on CPU (Triton's interpreter) and writes its rows."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool():
    sys.path.insert(0, str(TOOLS))  # the tool imports bench_moe's case table, as when run from tools/
    try:
        spec = importlib.util.spec_from_file_location("bench_epilogues", TOOLS / "bench_epilogues.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(TOOLS))
    return bench


@pytest.mark.slow
def test_bench_epilogues_toy_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "epilogues.json"
    _tool().main(["--toy", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["toy-top1", "toy-top2"]
    assert all(r[k] > 0 for r in rows for k in r if k.endswith("_us"))
    assert "| toy-top1 |" in capsys.readouterr().out


def test_bench_epilogues_refuses_a_swiglu_case(capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--cases", "deepseek-v2-lite"])
    assert "'deepseek-v2-lite' is not a GELU case" in capsys.readouterr().err
