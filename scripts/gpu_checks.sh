#!/usr/bin/env bash
# GPU checks on one CUDA machine: the gpu-marked tests, then short bf16 training runs of the default
# config (which must print no raw warning) and of the Small zoo models (dMoE and dense). Logs and
# each run's metrics.jsonl go to OUT_DIR; the run directories themselves (checkpoints, events) stay in RUNS_DIR (default /tmp).
# Usage: scripts/gpu_checks.sh OUT_DIR [STEPS]
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [STEPS]}
steps=${2:-150}
runs=${RUNS_DIR:-/tmp/gpu_check_runs}
mkdir -p "$out" "$runs"
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME COMMAND...: run one check, keep going, remember failures
    local name=$1; shift
    echo "=== $name"
    if "$@" > "$out/$name.log" 2>&1; then echo "ok   $name"; else echo "FAIL $name (see $name.log)"; status=1; fi
    tail -n 3 "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step gpu_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/moe tests/model tests/kernels tests/inference
common=(training.bf16=true moe.backend=grouped logging.progress_bar=off logging.log_interval=10)
step train_tiny python3 -m megatron_dmoe "${common[@]}" --run-dir "$runs/tiny"
# the default run captures its layers on a GPU: nothing in its output may be a raw Python warning
# ("file.py:N: SomeWarning: ...") or a C++ one ("[W...]"); ours print as "dmoe-train: warning: ..."
step no_raw_warnings bash -c "! grep -nE '^[^ ]+\.py:[0-9]+: [A-Za-z]*Warning|\[W[0-9]' '$out/train_tiny.log'"
small=("${common[@]}" "training.train_iters=$steps" training.lr_warmup_iters=20 training.global_batch_size=64
       training.eval_interval=50 training.eval_iters=2 checkpoint.save_interval=0 data.builtin_vocab_size=8192)
step train_dmoe_small python3 -m megatron_dmoe zoo/dmoe_small "${small[@]}" --run-dir "$runs/dmoe_small"
step train_dense_small python3 -m megatron_dmoe zoo/dense_small "${small[@]}" --run-dir "$runs/dense_small"
for run in tiny dmoe_small dense_small; do
    cp "$runs/$run/metrics.jsonl" "$out/$run.metrics.jsonl" 2>/dev/null
done
echo "=== summary (mean of logged steps after the first)"
python3 - "$out" <<'PY'
import json, pathlib, sys
for run in ("tiny", "dmoe_small", "dense_small"):
    path = pathlib.Path(sys.argv[1]) / f"{run}.metrics.jsonl"
    if not path.exists() or not path.read_text().strip():
        print(f"{run:12s} no metrics"); continue
    recs = [json.loads(l) for l in path.read_text().splitlines()]
    tail = recs[1:] or recs
    tps = sum(r["tokens_per_s"] for r in tail) / len(tail)
    tfl = sum(r["tflops_per_gpu"] for r in tail) / len(tail)
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    print(f"{run:12s} steps {recs[-1]['step']:4d}  loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}  "
          f"val {val[-1] if val else float('nan'):.3f}  {tps:,.0f} tok/s  {tfl:.1f} TFLOP/s")
PY
exit $status
