#!/usr/bin/env bash
# Train with Megatron-LM's own pretrain_gpt.py and this repository's MoE layer spec (one GPU, or a
# parallel layout over several), check that the loss falls and that the aux losses appear in
# Megatron-LM's log, and compare the per-iteration loss with a reference run's log.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/megatron_lm_check.sh MEGATRON_LM_DIR [WHEEL_DIR] [--tp N] [--sp] [--pp N] [--ep N] [--etp N]
           [--nproc N] [--init DIR] [--reference LOG] [--tolerance T]
       scripts/megatron_lm_check.sh --compare LOG --reference LOG [--tolerance T]

Runs Megatron-LM's pretrain_gpt.py (a checkout of tag core_v0.16.1 or core_v0.19.0 at
MEGATRON_LM_DIR) with `--spec megatron_dmoe.model.spec dmoe_layer_spec`, mock data and
Megatron-LM's NullTokenizer, for a few dozen iterations, then checks Megatron-LM's log:
  - the `lm loss` of the last logged iteration is below 90 % of the first one;
  - `load_balancing_loss` (written by our layer into megatron-core's aux-loss tracker) is logged
    with a positive value;
  - with --reference LOG (the log of another run of this script, e.g. the one-GPU run): every
    iteration of the reference is in this run's log, with an `lm loss` that differs by at most T
    (--tolerance, absolute, default 2e-2: bf16 rounding).
Exits 0 when all hold, 1 otherwise, 2 on a setup problem. Nothing is downloaded.

The layout (Megatron-LM's flags; the defaults are 1, on one GPU):
  --tp N      --tensor-model-parallel-size N
  --sp        --sequence-parallel (needs --tp 2 or more)
  --pp N      --pipeline-model-parallel-size N
  --ep N      --expert-model-parallel-size N
  --etp N     --expert-tensor-parallel-size N (default 1: Megatron-LM would take --tp, and refuses
              the experts' biases, which its defaults add, at any other size)
  --nproc N   processes (GPUs) for torchrun: default tp x pp x ep; the rest is data parallelism
Without --init, at 0.16, every run draws its weights on the CPU (--use-cpu-initialization), so one
seed gives the same model at any tensor-parallel size (0.19's pretrain_gpt.py cannot train a model
drawn on the CPU: its optimizer refuses the parameters left there); Megatron-LM offsets the seed per
pipeline stage, so a --pp run draws other weights. Dropout is off (--attention-dropout 0 --hidden-dropout 0): its masks depend on the
layout's random streams. To compare layouts, start every run, the reference included, from one
checkpoint:
  --init DIR  load the model from the Megatron-LM checkpoint in DIR (--load DIR --finetune
              --no-load-optim --no-load-rng --ckpt-format torch_dist --exit-on-missing-checkpoint:
              iteration, data order and learning-rate schedule start at 0). When DIR holds no
              checkpoint yet (no latest_checkpointed_iteration.txt; a missing or empty folder), a
              one-GPU run of one iteration at learning rate 0 first saves the weights drawn from the
              seed there (--save DIR --save-interval 1 --ckpt-format torch_dist --no-save-optim
              --no-save-rng; log WORK_DIR/init.log). torch_dist checkpoints load at any TP, PP and
              EP size. A folder that holds other files is refused.
The log is WORK_DIR/train_<layout>.log: train_tp1_pp1_ep1.log for the one-GPU run,
train_tp2_sp_pp1_ep1.log, ... For example, on two GPUs:
  export TRAIN_ITERS=20 REF=/tmp/megatron_lm_check/train_tp1_pp1_ep1.log INIT=/tmp/megatron_lm_check/init
  scripts/megatron_lm_check.sh MLM --init $INIT                    # the reference: one GPU
  scripts/megatron_lm_check.sh MLM --init $INIT --tp 2 --sp --reference $REF
  scripts/megatron_lm_check.sh MLM --init $INIT --pp 2 --reference $REF
  scripts/megatron_lm_check.sh MLM --init $INIT --ep 2 --reference $REF
With --compare LOG, nothing runs: the `lm loss` of LOG is compared with --reference's, iteration
by iteration, and one line tells how many iterations were compared and the largest difference
(exit 0 within --tolerance, 1 otherwise).

The script learns the checkout's release from its git tag, or (a checkout without git metadata)
from its megatron/core/package_info.py, and requires the installed megatron-core to be the same
minor release: Megatron-LM's training code at core_v0.19.0 does not run on megatron-core 0.16 and
vice versa.

Megatron-LM's training code comes from the checkout (pretrain_gpt.py, gpt_builders.py,
model_provider.py and every folder of megatron/ except core: training, post_training, rl, and
legacy at 0.16, elastification and inference at 0.19) and megatron-core from the installed wheel:
the two `megatron` trees merge as a namespace package. When megatron.core or pydantic cannot be
imported, WHEEL_DIR must hold wheels of megatron-core (0.16.1 or 0.19.x, matching the checkout),
pydantic, pydantic-core, annotated-types, typing-inspection and typing-extensions (>= 4.16); they
are installed, without dependencies, into the work folder, and kept there for the next run with the
same WORK_DIR (make them elsewhere with
`pip download megatron-core==0.16.1 pydantic 'typing-extensions>=4.16' -d WHEEL_DIR`; the 0.19
wheel is not on the registry: copy it from ../shared/wheels/megatron-core-0.19/).
The checkout's dataset-helper sources (Makefile, helpers.cpp) are copied next to the installed
megatron-core, since Megatron-LM compiles the helpers at start-up (needs make, a C++ compiler and
pybind11).

Settings (environment):
  WORK_DIR    work folder: staged imports, logs, TensorBoard events (default /tmp/megatron_lm_check)
  TRAIN_ITERS iterations (default 40)
  PYTHON      python interpreter (default python3)
  MASTER_PORT torchrun's rendezvous port on this host (default: a free one, torchrun --standalone);
              set it to run two checks side by side
  CUDA_VISIBLE_DEVICES  the GPUs to use (default: the first --nproc)
EOF
}

fail_setup() { echo "megatron_lm_check: error: $*" >&2; exit 2; }

# "iteration    5/   40 | ... | lm loss: 1.043921E+01 | ..." -> "5 1.043921E+01" (a loss that is not a
# number is left out)
per_iteration() { sed -n 's/.*iteration *\([0-9][0-9]*\)\/.*lm loss: \([0-9][0-9.E+-]*\).*/\1 \2/p' "$1"; }

# compare_losses REFERENCE_LOG LOG TOLERANCE: one line (iterations compared, largest difference);
# status 1 when an iteration differs by more than TOLERANCE, or LOG lacks one of the reference's
# iterations (a run cut short, or a loss that is not a number), or none is in both logs
compare_losses() {
    awk -v tol="$3" 'BEGIN { worst = 0; at = "-" }
        NR == FNR { ref[$1] = $2; nref++; next }
        ($1 in ref) && !($1 in seen) { seen[$1] = 1; n++; d = $2 - ref[$1]; if (d < 0) d = -d
                      if (d > worst) { worst = d; at = $1 }
                      if (d > tol + 0) bad++ }
        END { if (n == 0) { print "no iteration in common with the reference"; exit 1 }
              printf "%d iterations compared, largest difference %.3g (iteration %s)", n, worst, at
              if (n < nref) printf "; %d of the reference'"'"'s %d iterations missing", nref - n, nref
              printf "\n"
              exit (bad > 0 || n < nref) }' <(per_iteration "$1") <(per_iteration "$2")
}

tp=1 pp=1 ep=1 etp=1 sp=0 nproc="" reference="" tolerance=2e-2 init="" compare=""
positional=()
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --sp) sp=1; shift ;;
        --tp|--pp|--ep|--etp|--nproc|--reference|--tolerance|--init|--compare)
            [[ $# -ge 2 ]] || fail_setup "$1 needs a value (see --help)"
            case $1 in
                --tp) tp=$2 ;;
                --pp) pp=$2 ;;
                --ep) ep=$2 ;;
                --etp) etp=$2 ;;
                --nproc) nproc=$2 ;;
                --reference) reference=$2 ;;
                --tolerance) tolerance=$2 ;;
                --init) init=$2 ;;
                --compare) compare=$2 ;;
            esac
            shift 2 ;;
        -*) fail_setup "unknown option $1 (see --help)" ;;
        *) positional+=("$1"); shift ;;
    esac
done
awk -v t="$tolerance" 'BEGIN { exit !(t + 0 > 0) }' || fail_setup "--tolerance $tolerance: give a positive number"
if [[ -n $reference && ! -f $reference ]]; then fail_setup "--reference $reference: no such log file"; fi

# -- --compare: two logs, nothing run ------------------------------------------------------------------
if [[ -n $compare ]]; then
    [[ ${#positional[@]} -eq 0 && -z $init ]] \
        || fail_setup "--compare LOG runs nothing: give it only --reference LOG and --tolerance (see --help)"
    [[ -n $reference ]] || fail_setup "--compare $compare needs --reference LOG to compare with"
    [[ -f $compare ]] || fail_setup "--compare $compare: no such log file"
    if verdict=$(compare_losses "$reference" "$compare" "$tolerance"); then
        echo "megatron_lm_check: ok: lm loss within $tolerance of $reference: $verdict"; exit 0
    fi
    echo "megatron_lm_check: FAIL: lm loss differs from $reference by more than $tolerance: $verdict" >&2
    exit 1
fi

if [[ ${#positional[@]} -lt 1 || ${#positional[@]} -gt 2 ]]; then usage >&2; exit 2; fi
for pair in "--tp:$tp" "--pp:$pp" "--ep:$ep" "--etp:$etp" "--nproc:${nproc:-1}"; do
    [[ ${pair#*:} =~ ^[1-9][0-9]*$ ]] || fail_setup "${pair%%:*} ${pair#*:}: give a positive integer"
done
nproc=${nproc:-$((tp * pp * ep))}
(( nproc % (tp * pp) == 0 )) || fail_setup "--nproc $nproc is not a multiple of --tp x --pp ($((tp * pp)))"
(( (nproc / pp) % ep == 0 )) || fail_setup "--ep $ep does not divide the $((nproc / pp)) processes of a pipeline stage"
(( (nproc / pp) % (ep * etp) == 0 )) \
    || fail_setup "--ep $ep x --etp $etp does not divide the $((nproc / pp)) processes of a pipeline stage"
(( sp == 0 || tp > 1 )) || fail_setup "--sp splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more"
if [[ -n ${MASTER_PORT:-} ]] && ! [[ $MASTER_PORT =~ ^[1-9][0-9]*$ && $MASTER_PORT -le 65535 ]]; then
    fail_setup "MASTER_PORT '$MASTER_PORT': give a port number (1-65535), or leave it unset for a free one"
fi
if [[ -n $init ]]; then
    if [[ -e $init && ! -d $init ]]; then fail_setup "--init $init is a file: give a checkpoint folder"; fi
    if [[ -d $init && ! -f $init/latest_checkpointed_iteration.txt && -n $(ls -A "$init") ]]; then
        fail_setup "--init $init holds files but no Megatron-LM checkpoint (no latest_checkpointed_iteration.txt): give an empty or new folder, or a checkpoint's"
    fi
    init=$(realpath -m -- "$init")
fi

mlm=$(cd "${positional[0]}" 2>/dev/null && pwd -P) || fail_setup "MEGATRON_LM_DIR '${positional[0]}' is not a folder"
wheels=${positional[1]:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${WORK_DIR:-/tmp/megatron_lm_check}
iters=${TRAIN_ITERS:-40}
python=${PYTHON:-python3}
layout=tp${tp}
if [[ $sp == 1 ]]; then layout+=_sp; fi
layout+=_pp${pp}_ep${ep}
if [[ $etp != 1 ]]; then layout+=_etp${etp}; fi

# -- which Megatron-LM release the checkout is -------------------------------------------------------
tag=""
# (a checkout's own git metadata only: a copy inside another repository, as .mlm/ here, has none)
if [[ $(git -C "$mlm" rev-parse --show-toplevel 2>/dev/null) == "$mlm" ]]; then
    tag=$(git -C "$mlm" describe --tags --exact-match 2>/dev/null || true)
fi
if [[ -z $tag && -f $mlm/megatron/core/package_info.py ]]; then
    # no tag (a copy, or a commit between tags): the release its megatron/core names
    tag=$(cd "$mlm/megatron/core" && "$python" -c \
        "import package_info as p; print(f'core_v{p.MAJOR}.{p.MINOR}.{p.PATCH}')" 2>/dev/null || true)
fi
case $tag in
    core_v0.16.*) release=0.16; pieces=(megatron/legacy) ;;
    core_v0.19.*) release=0.19; pieces=() ;;
    *) fail_setup "cannot tell which Megatron-LM release $mlm is ('${tag:-no tag, no megatron/core/package_info.py}'); check out tag core_v0.16.1 or core_v0.19.0" ;;
esac
echo "megatron_lm_check: Megatron-LM checkout at $tag"
for piece in pretrain_gpt.py gpt_builders.py model_provider.py megatron/training megatron/post_training \
        megatron/rl megatron/core/datasets/Makefile megatron/core/datasets/helpers.cpp "${pieces[@]}"; do
    [[ -e $mlm/$piece ]] || fail_setup "$mlm/$piece is missing: MEGATRON_LM_DIR must be a Megatron-LM checkout (tag $tag)"
done

# -- imports: staged checkout pieces, this repository, wheels if needed -------------------------------
# the wheels installed into $work/site stay for the next run with this WORK_DIR (reinstalled when the
# release differs)
rm -rf "$work/stage" && mkdir -p "$work/stage/megatron" "$work/site"
for tree in "$mlm"/megatron/*/; do
    tree=$(basename "$tree")
    [[ $tree == core ]] || ln -s "$mlm/megatron/$tree" "$work/stage/megatron/$tree"
done
# copies, not links: Python puts the script's resolved folder first on sys.path, and the checkout's
# own megatron/core must not shadow the installed megatron-core. The builders (gpt_builders.py,
# and hybrid_builders.py / mamba_builders.py where the checkout has them) are imported by name.
for file in "$mlm"/pretrain_gpt.py "$mlm"/*_builders.py "$mlm"/model_provider.py; do
    cp "$file" "$work/stage/$(basename "$file")"
done
ln -sfn "$repo/kernels" "$work/stage/dmoe_kernels"
ln -sfn "$repo/configs" "$work/stage/megatron_dmoe_configs"
export PYTHONPATH="$work/stage:$repo:$work/site${PYTHONPATH:+:$PYTHONPATH}"

matching="import pydantic; from megatron.core import package_info as p; assert f'{p.MAJOR}.{p.MINOR}' == '$release'"
if ! "$python" -c "$matching" 2>/dev/null; then
    [[ -n $wheels ]] || fail_setup "megatron-core $release or pydantic cannot be imported, and no WHEEL_DIR was given (see --help)"
    shopt -s nullglob
    files=("$wheels"/*.whl)
    shopt -u nullglob
    [[ ${#files[@]} -gt 0 ]] || fail_setup "WHEEL_DIR '$wheels' holds no .whl files"
    rm -rf "$work/site" && mkdir -p "$work/site"
    "$python" -m pip install --quiet --no-index --no-deps --target "$work/site" "${files[@]}" \
        || fail_setup "installing the wheels of $wheels failed"
    "$python" -c "import megatron.core, pydantic" \
        || fail_setup "megatron.core or pydantic still cannot be imported after installing $wheels"
fi
read -r installed core_datasets < <("$python" -c "import os, megatron.core.datasets as d
from megatron.core import package_info as p
print(f'{p.MAJOR}.{p.MINOR}', os.path.dirname(d.__file__))")
[[ $installed == "$release" ]] \
    || fail_setup "the importable megatron-core is $installed, the checkout ($tag) needs $release: install megatron-core $release.x or pass its wheels as WHEEL_DIR"
# -p keeps the sources' times: make then rebuilds the helpers only when they changed
cp -p "$mlm/megatron/core/datasets/Makefile" "$mlm/megatron/core/datasets/helpers.cpp" "$core_datasets/"
"$python" -c "import megatron.training, megatron_dmoe.model.spec" \
    || fail_setup "Megatron-LM's training code or megatron_dmoe cannot be imported with PYTHONPATH=$PYTHONPATH"

# -- the run -------------------------------------------------------------------------------------------
model=(
    --spec megatron_dmoe.model.spec dmoe_layer_spec
    # no apex, no Transformer Engine
    --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-per-layer-logging
    # dropout masks come from per-rank random streams that differ between layouts
    --attention-dropout 0 --hidden-dropout 0
    # 4 micro-batches per step: the aux-loss gradient is scaled by megatron's schedule
    --micro-batch-size 4 --global-batch-size 16
    --bf16 --seed 1234
    # every iteration's loss, to compare runs iteration by iteration
    --log-interval 1 --eval-interval 20 --eval-iters 1
)
# without a starting checkpoint, the whole weights drawn on the CPU from the seed, then split: the same
# model at any TP size (with --init every run loads its weights, and the starting run has one GPU).
# Not at 0.19: its pretrain_gpt.py leaves a model drawn on the CPU there (the device move in
# megatron/training/models/dist_utils.py skips it) and its optimizer then refuses the parameters.
if [[ -z $init && $release == 0.16 ]]; then model+=(--use-cpu-initialization); fi
if [[ -n ${MASTER_PORT:-} ]]; then
    rendezvous=(--nnodes 1 --node-rank 0 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
    rendezvous=(--standalone)
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1

# pretrain NPROC LOG ARGS...: Megatron-LM's pretrain_gpt.py under torchrun; status 1 (and the log's
# tail) when it fails
pretrain() {
    local procs=$1 out=$2 status
    shift 2
    set +e
    "$python" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$procs" \
        "$work/stage/pretrain_gpt.py" "${model[@]}" "$@" > "$out" 2>&1
    status=$?
    set -e
    if [[ $status -ne 0 ]]; then
        tail -n 30 "$out" >&2
        echo "megatron_lm_check: FAIL: pretrain_gpt.py exited with $status (log: $out)" >&2
        return 1
    fi
}

checkpoint=()
if [[ -n $init ]]; then
    if [[ ! -f $init/latest_checkpointed_iteration.txt ]]; then
        # the weights drawn from the seed on one GPU: one step at learning rate 0 changes none
        echo "megatron_lm_check: saving the starting checkpoint in $init (one GPU, one iteration at lr 0; log in $work/init.log)"
        mkdir -p "$init"
        pretrain 1 "$work/init.log" --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
            --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --train-iters 1 --lr 0 --min-lr 0 --lr-warmup-iters 0 \
            --lr-decay-style constant --save "$init" --save-interval 1 --ckpt-format torch_dist \
            --no-save-optim --no-save-rng || exit 1
        [[ -f $init/latest_checkpointed_iteration.txt ]] || {
            echo "megatron_lm_check: FAIL: the starting run saved no checkpoint in $init (log: $work/init.log)" >&2; exit 1; }
    fi
    checkpoint=(--load "$init" --finetune --no-load-optim --no-load-rng --ckpt-format torch_dist
                --exit-on-missing-checkpoint)
fi

log=$work/train_$layout.log
args=(
    --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" --expert-model-parallel-size "$ep"
    --expert-tensor-parallel-size "$etp"
    --train-iters "$iters" --lr 5e-4 --min-lr 5e-5 --lr-warmup-iters 5 --lr-decay-style cosine
    --tensorboard-dir "$work/tensorboard_$layout"
    "${checkpoint[@]}"
)
if [[ $sp == 1 ]]; then args+=(--sequence-parallel); fi
echo "megatron_lm_check: training $iters iterations at $layout on $nproc process(es)${init:+ from $init}; log in $log"
pretrain "$nproc" "$log" "${args[@]}" || exit 1
if [[ -n $init ]] && ! grep -qF "successfully loaded checkpoint from $init " "$log"; then
    echo "megatron_lm_check: FAIL: Megatron-LM's log does not say it loaded the checkpoint in $init (log: $log)" >&2
    exit 1
fi

# -- the checks ----------------------------------------------------------------------------------------
mapfile -t losses < <(grep -o 'lm loss: [0-9.E+-]*' "$log" | awk '{print $3}')
mapfile -t aux < <(grep -o 'load_balancing_loss: [0-9.E+-]*' "$log" | awk '{print $2}')
ok=0
if [[ ${#losses[@]} -lt 2 ]]; then
    echo "megatron_lm_check: FAIL: fewer than two 'lm loss' values in the log" >&2; ok=1
elif ! awk -v a="${losses[0]}" -v b="${losses[-1]}" 'BEGIN { exit !(b < 0.9 * a) }'; then
    echo "megatron_lm_check: FAIL: lm loss did not fall: ${losses[0]} -> ${losses[-1]}" >&2; ok=1
else
    echo "megatron_lm_check: ok: lm loss ${losses[0]} -> ${losses[-1]}"
fi
if [[ ${#aux[@]} -eq 0 ]]; then
    echo "megatron_lm_check: FAIL: no load_balancing_loss in Megatron-LM's log" >&2; ok=1
elif ! awk -v a="${aux[-1]}" 'BEGIN { exit !(a > 0) }'; then
    echo "megatron_lm_check: FAIL: load_balancing_loss is ${aux[-1]}" >&2; ok=1
else
    echo "megatron_lm_check: ok: load_balancing_loss logged ${#aux[@]} times, last ${aux[-1]}"
fi
grep -o 'expert_load_imbalance: [0-9.E+-]*' "$log" | tail -n 1 | sed 's/^/megatron_lm_check: /' || true
if [[ -n $reference ]]; then
    if ! verdict=$(compare_losses "$reference" "$log" "$tolerance"); then
        echo "megatron_lm_check: FAIL: lm loss differs from $reference by more than $tolerance: $verdict" >&2; ok=1
    else
        echo "megatron_lm_check: ok: lm loss within $tolerance of $reference: $verdict"
    fi
fi
exit $ok
