"""Everything the 4-process test runs in one spawn (process start-up dominates on two cores)."""
import importlib.util
from pathlib import Path

from ep_layer_checks import check_layer_cases
from ep_state_checks import check_state

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_ep.py"
# tiny sizes; 2 experts so that EP = 4 splits each expert's FFN over two ranks
BENCH_ARGS = ["--device", "cpu", "--tokens", "24", "--hidden", "8", "--ffn", "16", "--experts", "2",
              "--top-k", "1", "--ep", "1,2,3,4", "--iters", "2", "--warmup", "1", "--shared-ffn", "8",
              # 24 and 48 rows of 8 float32 values per exchange
              "--exchange-mib", f"{24 * 32 / 2**20},{48 * 32 / 2**20}"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_ep", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(bench_out: str) -> None:
    check_layer_cases()
    check_state()
    # last: the benchmark tears the process group down when it ends
    load_bench().main(BENCH_ARGS + ["--out", bench_out])
