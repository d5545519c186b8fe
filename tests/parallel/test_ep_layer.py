"""Expert parallelism in 4 gloo processes, against the single-process layer and global quantities.

One spawn runs every check (process start-up dominates the time on two cores):
  * the EP layer's output and every gradient equal the single-process layer's (ep_layer_checks),
    for EP = 2 (two expert-parallel groups) and 4, whole experts and FFNs split over ranks, top-1
    and top-k, experts and whole ranks that receive no token, padding, both expert backends;
  * the clipping norm is the global gradient norm; initialisation does not depend on EP; the
    experts' checkpoint tensors are indexed globally and written once (ep_state_checks);
  * tools/bench_ep.py runs at EP = 1, 2, 4 on gloo and reports what it moved (checked here).
"""
import json
import subprocess
import sys

from four_process_checks import BENCH, load_bench, run_all
from process_group import run_in_processes


def test_expert_parallel_layer_state_and_benchmark_in_four_processes(tmp_path):
    out = tmp_path / "bench.json"
    run_in_processes(4, run_all, str(out))

    results = json.loads(out.read_text())
    assert results["world_size"] == 4 and results["skipped_ep"] == [3]
    layer = {row["ep"]: row for row in results["layer"]}
    assert sorted(layer) == [1, 2, 4]
    assert (layer[1]["local_experts"], layer[2]["local_experts"], layer[4]["local_experts"]) == (2, 1, 1)
    assert layer[4]["local_ffn"] == 8  # 2 experts over 4 ranks: half an FFN each
    assert all(row["layer_fwd_bwd_ms"] > 0 and row["layer_tokens_per_s"] > 0 for row in layer.values())
    # --shared-ffn: the layer with a shared expert, without it, and the shared MLP alone
    assert all(row["shared_ffn"] == 8 and row["layer_without_shared_ms"] > 0 and row["shared_alone_ms"] > 0
               and isinstance(row["shared_hidden"], float) for row in layer.values())
    exchange = [(row["ep"], row["exchange_bytes_per_rank"]) for row in results["exchange"]]
    # every row (a token copy to each FFN shard: 12 tokens x 2 shards at EP = 4) goes out and comes
    # back: 24 or 48 rows of 8 float32 values; EP = 1 exchanges nothing
    assert exchange == [(ep, 2 * rows * 8 * 4) for ep in (2, 4) for rows in (24, 48)]
    assert [row["tokens_per_rank"] for row in results["exchange"]] == [24, 48, 12, 24]
    for row in results["exchange"]:
        assert row["raw_bytes_per_rank"] >= row["exchange_bytes_per_rank"]
        for key in ("dispatch_combine_ms", "dispatch_busbw_gbs", "raw_all_to_all_ms", "raw_busbw_gbs", "efficiency"):
            assert row[key] > 0, (row["ep"], key)
    bench = load_bench()
    table = bench.format_table(results["exchange"]).splitlines()
    assert len(table) == 5 and "disp+comb ms" in table[0] and table[1].split()[0] == "2"
    assert len(bench.format_table(results["layer"], bench.LAYER_COLUMNS).splitlines()) == 4
    assert "shared time hidden" in bench.format_table(results["layer"], bench.SHARED_COLUMNS).splitlines()[0]


def test_benchmark_help_names_the_nccl_environment():
    result = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for setting in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert setting in result.stdout
