"""tools/bench_launch.py runs on CPU (Triton's interpreter) and writes one row per call it times."""
import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_launch.py"


def test_bench_launch_writes_its_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_launch", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "launch.json"
    bench.main(["--device", "cpu", "--calls", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    calls = [r["call"] for r in data["rows"]]
    assert calls[0].startswith("torch") and calls[-1].startswith("ops.sdd")
    assert any("direct(kernel)" in c for c in calls)
    assert all(r["host_us"] > 0 for r in data["rows"]) and data["meta"]["calls"] == 2
    assert "host microseconds per call" in capsys.readouterr().out
