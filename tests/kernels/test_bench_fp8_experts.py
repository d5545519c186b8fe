"""tools/bench_fp8_experts.py runs its tiny cases on CPU (Triton's interpreter, the fp8 rows) and
writes its rows, each checked against float64."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_fp8_experts.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_fp8_experts", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="--toy needs Triton's interpreter in this process")
def test_bench_fp8_experts_toy_writes_checked_rows(tmp_path, capsys):
    bench = _tool()
    out = tmp_path / "fp8_experts.json"
    assert bench.main(["--toy", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["case"], r["product"]) for r in rows] == [
        (case, prod) for case in bench.TOY_CASES for prod in bench.PRODUCTS]
    for r in rows:
        assert r["ok"] is True and 0 < r["fp8_max_rel_error"] <= bench.MAX_REL_ERROR
        assert r["fp8_ms"] > 0 and "speedup" not in r
    assert [q["case"] for q in result["quantization"]] == list(bench.TOY_CASES)
    table = capsys.readouterr().out
    assert all(any(r["case"] in line and r["product"] in line for line in table.splitlines()) for r in rows)


def test_bench_fp8_experts_names_an_unknown_case():
    with pytest.raises(SystemExit):
        _tool().parse_args(["--cases", "no-such-case"])
