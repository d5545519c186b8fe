#!/usr/bin/env bash
# Launch dmoe-train on this node through its launcher (dmoe-train --nproc-per-node, torchrun's own
# machinery): one process per GPU (one on CPU), one node or many.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/train.sh [--dry-run] [CONFIG] [section.key=value ...] [-- DMOE_TRAIN_FLAGS ...]

Runs `dmoe-train --nproc-per-node N CONFIG section.key=value ... DMOE_TRAIN_FLAGS`: the
configuration is checked once, then one process per GPU of this node starts through torchrun's
launcher (one process without a GPU: gloo on CPU); a refusal or a failed process is one line. With
NNODES > 1, run the same command on every node; the nodes meet at a rendezvous given by the
environment.

  scripts/train.sh tiny training.train_iters=50
  NPROC_PER_NODE=4 scripts/train.sh zoo/dmoe_small -- --run-dir runs/small
  # two nodes, static rendezvous (run on each node with its own NODE_RANK):
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 scripts/train.sh zoo/dmoe_medium -- --run-dir runs/m
  # or torchrun's c10d rendezvous (the same command on every node):
  NNODES=2 RDZV_ENDPOINT=node0:29400 RDZV_ID=medium scripts/train.sh zoo/dmoe_medium -- --run-dir runs/m

Options:
  --dry-run    print the dmoe-train command instead of running it
  -h, --help   show this help

Environment:
  NPROC_PER_NODE  processes on this node (default: the GPUs torch sees, or 1 without a GPU)
  NNODES          number of nodes (default 1)
  NODE_RANK       this node's rank, 0 .. NNODES-1 (static rendezvous; default 0)
  MASTER_ADDR     host of node 0 (static rendezvous); needed when NNODES > 1 unless RDZV_ENDPOINT
  MASTER_PORT     port on MASTER_ADDR (default 29500)
  RDZV_ENDPOINT   host:port of torchrun's c10d rendezvous, used instead of MASTER_ADDR/NODE_RANK
  RDZV_ID         id shared by the nodes of one run, with RDZV_ENDPOINT (default dmoe)
  PYTHON          the Python that has megatron_dmoe installed (default python3)
  TORCHRUN_ARGS   more of torchrun's options (e.g. "--max_restarts 3"), given to dmoe-train as
                  --torchrun-args
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT
                  seconds torchrun waits after passing on SIGTERM before it kills the training
                  processes, which use them to save a checkpoint (default here 100)
  LAUNCHER_PID_FILE
                  write the launcher's process id to this file (train.sbatch reads it to signal
                  the launcher's children, the training processes)
Everything else in the environment (NCCL_*, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, ...) reaches
the training processes unchanged.
EOF
}

die() {
  echo "train.sh: error: $*" >&2
  exit 2
}

dry_run=0
while [[ $# -gt 0 ]]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    *) break ;;
  esac
done

# dmoe-train reads its flags anywhere on the line; the `--` only separates them from ours.
args=()
separated=0
for arg in "$@"; do
  if [[ $arg == "--" && $separated == 0 ]]; then
    separated=1
  else
    args+=("$arg")
  fi
done

is_count() { [[ $1 =~ ^[0-9]+$ ]] && ((10#$1 >= $2)); }

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON is not a command; set PYTHON to the Python that has megatron_dmoe installed"

NNODES=${NNODES:-1}
is_count "$NNODES" 1 || die "NNODES=$NNODES: use a number of nodes >= 1"
if [[ -n ${NPROC_PER_NODE:-} ]]; then
  is_count "$NPROC_PER_NODE" 1 || die "NPROC_PER_NODE=$NPROC_PER_NODE: use a number of processes >= 1"
fi

launch=(--nnodes="$NNODES")
if [[ -n ${RDZV_ENDPOINT:-} ]]; then
  [[ $RDZV_ENDPOINT == *:* ]] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT: use host:port"
  launch+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-dmoe}")
  where="c10d rendezvous at $RDZV_ENDPOINT"
elif [[ -n ${MASTER_ADDR:-} ]]; then
  NODE_RANK=${NODE_RANK:-0}
  MASTER_PORT=${MASTER_PORT:-29500}
  is_count "$NODE_RANK" 0 && ((10#$NODE_RANK < NNODES)) ||
    die "NODE_RANK=$NODE_RANK: use this node's rank, 0 to $((NNODES - 1))"
  is_count "$MASTER_PORT" 1 || die "MASTER_PORT=$MASTER_PORT: use a port number"
  launch+=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
  where="node $NODE_RANK, rendezvous at $MASTER_ADDR:$MASTER_PORT"
elif ((NNODES > 1)); then
  die "NNODES=$NNODES needs a rendezvous: set MASTER_ADDR (with NODE_RANK and MASTER_PORT) or RDZV_ENDPOINT"
else
  launch=()
  where="standalone"
fi

if [[ -z ${NPROC_PER_NODE:-} ]]; then
  gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())') ||
    die "could not count GPUs with $PYTHON (is torch installed?); set NPROC_PER_NODE"
  NPROC_PER_NODE=$((gpus > 0 ? gpus : 1))
fi
launch=(--nproc-per-node="$NPROC_PER_NODE" "${launch[@]}")
if [[ -n ${TORCHRUN_ARGS:-} ]]; then
  launch+=(--torchrun-args="$TORCHRUN_ARGS")
fi

# The launcher passes SIGTERM on to the training processes, which save a checkpoint and stop; give
# them time before it kills them (SLURM's preemption notice comes 120 s ahead).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}

command=("$PYTHON" -m megatron_dmoe "${launch[@]}" "${args[@]}")
if ((dry_run)); then
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi
nccl=$(env | grep -E '^NCCL_' | sort | tr '\n' ' ' || true)
echo "train.sh: $NNODES node(s) x $NPROC_PER_NODE process(es), $where${nccl:+; $nccl}" >&2
if [[ -n ${LAUNCHER_PID_FILE:-} ]]; then
  echo $$ >"$LAUNCHER_PID_FILE" # exec keeps the process id: it becomes the launcher's
fi
exec "${command[@]}"
