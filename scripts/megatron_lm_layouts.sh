#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with this repository's layer spec at TP 2 + SP, PP 2 and EP 2 on two
# GPUs, each against the one-GPU run from the same starting checkpoint: megatron_lm_check.sh once per
# layout, then one table. See --help.
set -uo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/megatron_lm_layouts.sh MEGATRON_LM_DIR [WHEEL_DIR]

Runs scripts/megatron_lm_check.sh (its --help says what each run checks) with --init, in this order:
  1. the starting checkpoint and the one-GPU reference (tp1_pp1_ep1);
  2. --tp 2 --sp, --pp 2 and --ep 2 on two GPUs, each with --reference the one-GPU run's log;
then prints one line per layout (iterations compared, largest lm-loss difference, verdict) and
exits 0 when every layout passed, 1 otherwise, 2 on a setup problem. Each run's output is in
WORK_DIR/<layout>.out, Megatron-LM's logs in WORK_DIR/train_<layout>.log.

Settings (environment), as megatron_lm_check.sh's: WORK_DIR (default /tmp/megatron_lm_layouts),
TRAIN_ITERS (default 20), PYTHON, MASTER_PORT (each layout takes the next port from it),
CUDA_VISIBLE_DEVICES (at least two GPUs), and
  LAYOUT_TIMEOUT  seconds at most for one run (default 900): a run that hangs costs no more
EOF
}

fail_setup() { echo "megatron_lm_layouts: error: $*" >&2; exit 2; }

case ${1:-} in -h|--help) usage; exit 0 ;; esac
[[ $# -ge 1 && $# -le 2 ]] || { usage >&2; exit 2; }
[[ -d $1 ]] || fail_setup "MEGATRON_LM_DIR '$1' is not a folder"
[[ $# -lt 2 || -d $2 ]] || fail_setup "WHEEL_DIR '$2' is not a folder"
timeout_s=${LAYOUT_TIMEOUT:-900}
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || fail_setup "LAYOUT_TIMEOUT '$timeout_s': give a number of seconds"
port=${MASTER_PORT:-}
[[ -z $port || $port =~ ^[1-9][0-9]*$ ]] || fail_setup "MASTER_PORT '$port': give a port number"

check=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/megatron_lm_check.sh
export WORK_DIR=${WORK_DIR:-/tmp/megatron_lm_layouts} TRAIN_ITERS=${TRAIN_ITERS:-20}
mkdir -p "$WORK_DIR"
init=$WORK_DIR/init reference=$WORK_DIR/train_tp1_pp1_ep1.log

# run NAME ARGS...: one megatron_lm_check.sh run, its output in WORK_DIR/NAME.out, its status kept
declare -A status
run() {
    local name=$1
    shift
    if [[ -n $port ]]; then export MASTER_PORT=$port; port=$((port + 1)); fi
    echo "megatron_lm_layouts: $name ..."
    timeout "$timeout_s" bash "$check" "$@" > "$WORK_DIR/$name.out" 2>&1
    status[$name]=$?
}

run tp1_pp1_ep1 "$@" --init "$init"
if [[ ${status[tp1_pp1_ep1]} -eq 2 ]]; then
    tail -n 1 "$WORK_DIR/tp1_pp1_ep1.out" >&2
    exit 2
fi
layouts=(tp2_sp_pp1_ep1 tp1_pp2_ep1 tp1_pp1_ep2)
flags=("--tp 2 --sp" "--pp 2" "--ep 2")
if [[ ${status[tp1_pp1_ep1]} -eq 0 ]]; then
    for i in "${!layouts[@]}"; do
        # shellcheck disable=SC2086
        run "${layouts[$i]}" "$@" --init "$init" ${flags[$i]} --reference "$reference"
    done
fi

printf '%-16s %-10s %-13s %s\n' layout iterations largest_diff verdict
verdicts=0
for name in tp1_pp1_ep1 "${layouts[@]}"; do
    rc=${status[$name]:-}
    n=- diff=-
    if [[ $name != tp1_pp1_ep1 && -f $WORK_DIR/train_$name.log && -f $reference ]]; then
        line=$(bash "$check" --compare "$WORK_DIR/train_$name.log" --reference "$reference" 2>&1 | tail -n 1)
        n=$(sed -n 's/.*: \([0-9]*\) iterations compared.*/\1/p' <<<"$line")
        diff=$(sed -n 's/.*largest difference \([^ ]*\).*/\1/p' <<<"$line")
    fi
    case $rc in
        0) verdict=pass ;;
        "") verdict="not run (the one-GPU run failed)" ;;
        124) verdict="FAIL (stopped after LAYOUT_TIMEOUT=${timeout_s} s)" ;;
        *) verdict="FAIL (status $rc; see $WORK_DIR/$name.out)" ;;
    esac
    [[ $rc == 0 ]] || verdicts=1
    printf '%-16s %-10s %-13s %s\n' "$name" "${n:--}" "${diff:--}" "$verdict"
done
exit $verdicts
