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
    rows = {row["ep"]: row for row in results["rows"]}
    assert sorted(rows) == [1, 2, 4]
    assert (rows[1]["local_experts"], rows[2]["local_experts"], rows[4]["local_experts"]) == (2, 1, 1)
    assert rows[4]["local_ffn"] == 8  # 2 experts over 4 ranks: half an FFN each
    for ep in (2, 4):
        # every assignment (24 tokens x top-1 x ffn shards) goes out and comes back: 4-byte floats, hidden 8
        shards = 2 if ep == 4 else 1
        assert rows[ep]["exchange_bytes_per_rank"] == 2 * 24 * shards * 8 * 4
        assert rows[ep]["raw_bytes_per_rank"] >= rows[ep]["exchange_bytes_per_rank"]
        for key in ("dispatch_combine_ms", "dispatch_busbw_gbs", "raw_all_to_all_ms", "raw_busbw_gbs"):
            assert rows[ep][key] > 0, (ep, key)
    assert "dispatch_combine_ms" not in rows[1]
    assert all(row["layer_fwd_bwd_ms"] > 0 and row["layer_tokens_per_s"] > 0 for row in rows.values())
    table = load_bench().format_table(results["rows"]).splitlines()
    assert len(table) == 4 and "disp+comb ms" in table[0] and table[1].split()[:2] == ["1", "-"]


def test_benchmark_help_names_the_nccl_environment():
    result = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for setting in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert setting in result.stdout
