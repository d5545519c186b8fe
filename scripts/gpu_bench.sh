#!/usr/bin/env bash
# The speed measurements of the README's Performance section on one CUDA machine, each tool's table
# and JSON in OUT_DIR: with one GPU the host cost of a launch, GELU fused into the products, the MoE
# layer (both router paths, balanced and skewed routing, eager and as CUDA graphs) and whole-model
# training throughput (dense, dMoE, capacity factor, eager and graphs; micro-batch 16 and 32; the zoo's
# Small models as shipped; fp8 products against bf16); with
# two or more, the gpu-marked expert-parallel tests, the exchange and layer at EP 1 and 2 (with a
# shared expert), the exchange beside the experts' products, and training at EP 2 (and EP 4 with four GPUs) against data-parallel dense.
# Usage: scripts/gpu_bench.sh OUT_DIR [GPUS]    (GPUS: 1 (default), 2 or 4)
set -u
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR [GPUS]}
gpus=${2:-1}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
    NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
status=0
step() {  # step NAME COMMAND...: run one measurement, keep going, remember failures
    local name=$1; shift
    echo "=== $name"
    if "$@" > "$out/$name.log" 2>&1; then echo "ok   $name"; else echo "FAIL $name (see $name.log)"; status=1; fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$gpus" -ge 2 ]; then
    step ep_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/parallel
    step bench_ep torchrun --standalone --nproc_per_node 2 tools/bench_ep.py --ep 1,2 \
        --exchange nccl,symmetric --shared-ffn 1024 --out "$out/bench_ep.json"
    # how much of the exchange hides under the experts' products (what a chunked layer would win)
    step bench_overlap torchrun --standalone --nproc_per_node 2 tools/bench_overlap.py --ep 2 \
        --out "$out/bench_overlap.json"
    # the zoo's batch (global 512, micro-batch 16), every layer MoE: the fresh router's collapsed
    # routing (dmoe), evenly loaded experts (dmoe-balanced), those over the NVSHMEM exchange that
    # groups across hosts need (dmoe-nvshmem) and with the weight gradients once per window of
    # micro-batches (dmoe-window: 4 at EP 2, 2 at EP 4, where memory allows); a profiled step of
    # each says where the time goes (exchange waits, expert products, weight gradients, optimizer, rest)
    for ep in 2 4; do
        [ "$gpus" -ge "$ep" ] || continue
        step "bench_train_ep$ep" python3 tools/bench_train.py --nproc-per-node "$ep" --ep "$ep" \
            --models dense,dmoe,dmoe-balanced,dmoe-nvshmem,dmoe-window --wgrad-window $((8 / ep)) \
            --cuda-graphs both --global-batch-size 512 \
            --micro-batch-size 16 --steps 3 --warmup 2 --profile "$out/profile_ep$ep" \
            --out "$out/bench_train_ep$ep.json"
    done
else
    step bench_launch python3 tools/bench_launch.py --out "$out/bench_launch.json"
    step bench_epilogues python3 tools/bench_epilogues.py --out "$out/bench_epilogues.json"
    # the weight-gradient window's product at the zoo's one-GPU shapes, both epilogues
    step bench_wgrad_window python3 tools/bench_wgrad_window.py --out "$out/bench_wgrad_window.json"
    step bench_wgrad_window_skew python3 tools/bench_wgrad_window.py --skew --out "$out/bench_wgrad_window_skew.json"
    # block-scaled fp8 products (Triton, cuBLAS's torch._scaled_mm) against bf16, each checked first
    step bench_fp8 python3 tools/bench_fp8.py --out "$out/bench_fp8.json"
    for router in torch fused; do
        step "bench_moe_$router" python3 tools/bench_moe.py --graph --skew 2 --router "$router" \
            --out "$out/bench_moe_$router.json"
    done
    step bench_train python3 tools/bench_train.py --models dense,dmoe,capacity --cuda-graphs both \
        --out "$out/bench_train.json"
    step bench_train_mb32 python3 tools/bench_train.py --models dense,dmoe --cuda-graphs both \
        --micro-batch-size 32 --out "$out/bench_train_mb32.json"
    step bench_train_zoo python3 tools/bench_train.py --zoo --cuda-graphs both --out "$out/bench_train_zoo.json"
fi
for log in "$out"/*.log; do  # each tool's closing table
    echo "=== $(basename "$log" .log)"
    tail -n 25 "$log"
done
exit $status
