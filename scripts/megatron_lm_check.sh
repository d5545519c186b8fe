#!/usr/bin/env bash
# Train with Megatron-LM's own pretrain_gpt.py and this repository's MoE layer spec (one GPU, or a
# parallel layout over several), check that the loss falls and that the aux losses appear in
# Megatron-LM's log, and compare the per-iteration loss with a reference run's log.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/megatron_lm_check.sh MEGATRON_LM_DIR [WHEEL_DIR] [--tp N] [--sp] [--pp N] [--ep N]
           [--nproc N] [--reference LOG] [--tolerance T]

Runs Megatron-LM's pretrain_gpt.py (a checkout of tag core_v0.16.1 or core_v0.19.0 at
MEGATRON_LM_DIR) with `--spec megatron_dmoe.model.spec dmoe_layer_spec`, mock data and
Megatron-LM's NullTokenizer, for a few dozen iterations, then checks Megatron-LM's log:
  - the `lm loss` of the last logged iteration is below 90 % of the first one;
  - `load_balancing_loss` (written by our layer into megatron-core's aux-loss tracker) is logged
    with a positive value;
  - with --reference LOG (the log of another run of this script, e.g. the one-GPU run): the
    `lm loss` of every iteration both logs hold differs by at most T (--tolerance, absolute,
    default 2e-2: bf16 rounding).
Exits 0 when all hold, 1 otherwise, 2 on a setup problem. Nothing is downloaded.

The layout (Megatron-LM's flags; the defaults are 1, on one GPU):
  --tp N      --tensor-model-parallel-size N
  --sp        --sequence-parallel (needs --tp 2 or more)
  --pp N      --pipeline-model-parallel-size N
  --ep N      --expert-model-parallel-size N
  --nproc N   processes (GPUs) for torchrun: default tp x pp x ep; the rest is data parallelism
Every run draws its weights on the CPU (--use-cpu-initialization), so one seed gives the same model
at any tensor-parallel size (Megatron-LM offsets the seed per pipeline stage: a --pp run starts from
other weights). The log is WORK_DIR/train_<layout>.log: train_tp1_pp1_ep1.log for the one-GPU
run, train_tp2_sp_pp1_ep1.log, ... For example, on two GPUs:
  scripts/megatron_lm_check.sh MLM                  # the reference: one GPU, TRAIN_ITERS=20
  scripts/megatron_lm_check.sh MLM --tp 2 --sp --reference /tmp/megatron_lm_check/train_tp1_pp1_ep1.log

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
are installed, without dependencies, into the work folder (make them elsewhere with
`pip download megatron-core==0.16.1 pydantic 'typing-extensions>=4.16' -d WHEEL_DIR`; the 0.19
wheel is not on the registry: copy it from ../shared/wheels/megatron-core-0.19/).
The checkout's dataset-helper sources (Makefile, helpers.cpp) are copied next to the installed
megatron-core, since Megatron-LM compiles the helpers at start-up (needs make, a C++ compiler and
pybind11).

Settings (environment):
  WORK_DIR    work folder: staged imports, logs, TensorBoard events (default /tmp/megatron_lm_check)
  TRAIN_ITERS iterations (default 40)
  PYTHON      python interpreter (default python3)
  CUDA_VISIBLE_DEVICES  the GPUs to use (default: the first --nproc)
EOF
}

fail_setup() { echo "megatron_lm_check: error: $*" >&2; exit 2; }

# "iteration    5/   40 | ... | lm loss: 1.043921E+01 | ..." -> "5 1.043921E+01"
per_iteration() { sed -n 's/.*iteration *\([0-9][0-9]*\)\/.*lm loss: \([0-9.E+-]*\).*/\1 \2/p' "$1"; }

# compare_losses REFERENCE_LOG LOG TOLERANCE: one line (iterations compared, largest difference);
# status 1 when an iteration differs by more than TOLERANCE or none is in both logs
compare_losses() {
    awk -v tol="$3" 'BEGIN { worst = 0; at = "-" }
        NR == FNR { ref[$1] = $2; next }
        ($1 in ref) { n++; d = $2 - ref[$1]; if (d < 0) d = -d
                      if (d > worst) { worst = d; at = $1 }
                      if (d > tol + 0) bad++ }
        END { if (n == 0) { print "no iteration in common with the reference"; exit 1 }
              printf "%d iterations compared, largest difference %.3g (iteration %s)\n", n, worst, at
              exit bad > 0 }' <(per_iteration "$1") <(per_iteration "$2")
}

tp=1 pp=1 ep=1 sp=0 nproc="" reference="" tolerance=2e-2
positional=()
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --sp) sp=1; shift ;;
        --tp|--pp|--ep|--nproc|--reference|--tolerance)
            [[ $# -ge 2 ]] || fail_setup "$1 needs a value (see --help)"
            case $1 in
                --tp) tp=$2 ;;
                --pp) pp=$2 ;;
                --ep) ep=$2 ;;
                --nproc) nproc=$2 ;;
                --reference) reference=$2 ;;
                --tolerance) tolerance=$2 ;;
            esac
            shift 2 ;;
        -*) fail_setup "unknown option $1 (see --help)" ;;
        *) positional+=("$1"); shift ;;
    esac
done
if [[ ${#positional[@]} -lt 1 || ${#positional[@]} -gt 2 ]]; then usage >&2; exit 2; fi
for pair in "--tp:$tp" "--pp:$pp" "--ep:$ep" "--nproc:${nproc:-1}"; do
    [[ ${pair#*:} =~ ^[1-9][0-9]*$ ]] || fail_setup "${pair%%:*} ${pair#*:}: give a positive integer"
done
nproc=${nproc:-$((tp * pp * ep))}
(( nproc % (tp * pp) == 0 )) || fail_setup "--nproc $nproc is not a multiple of --tp x --pp ($((tp * pp)))"
(( (nproc / pp) % ep == 0 )) || fail_setup "--ep $ep does not divide the $((nproc / pp)) processes of a pipeline stage"
(( sp == 0 || tp > 1 )) || fail_setup "--sp splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more"
awk -v t="$tolerance" 'BEGIN { exit !(t + 0 > 0) }' || fail_setup "--tolerance $tolerance: give a positive number"
if [[ -n $reference && ! -f $reference ]]; then fail_setup "--reference $reference: no such log file"; fi

mlm=$(cd "${positional[0]}" 2>/dev/null && pwd) || fail_setup "MEGATRON_LM_DIR '${positional[0]}' is not a folder"
wheels=${positional[1]:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${WORK_DIR:-/tmp/megatron_lm_check}
iters=${TRAIN_ITERS:-40}
python=${PYTHON:-python3}
layout=tp${tp}
if [[ $sp == 1 ]]; then layout+=_sp; fi
layout+=_pp${pp}_ep${ep}

# -- which Megatron-LM release the checkout is -------------------------------------------------------
tag=""
if git -C "$mlm" rev-parse --git-dir >/dev/null 2>&1; then
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
rm -rf "$work/stage" "$work/site" && mkdir -p "$work/stage/megatron" "$work/site"
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
    "$python" -m pip install --quiet --no-index --no-deps --target "$work/site" "${files[@]}" \
        || fail_setup "installing the wheels of $wheels failed"
    "$python" -c "import megatron.core, pydantic" \
        || fail_setup "megatron.core or pydantic still cannot be imported after installing $wheels"
fi
installed=$("$python" -c "from megatron.core import package_info as p; print(f'{p.MAJOR}.{p.MINOR}')")
[[ $installed == "$release" ]] \
    || fail_setup "the importable megatron-core is $installed, the checkout ($tag) needs $release: install megatron-core $release.x or pass its wheels as WHEEL_DIR"
core_datasets=$("$python" -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))")
cp "$mlm/megatron/core/datasets/Makefile" "$mlm/megatron/core/datasets/helpers.cpp" "$core_datasets/"
"$python" -c "import megatron.training, megatron_dmoe.model.spec" \
    || fail_setup "Megatron-LM's training code or megatron_dmoe cannot be imported with PYTHONPATH=$PYTHONPATH"

# -- the run -------------------------------------------------------------------------------------------
log=$work/train_$layout.log
args=(
    --spec megatron_dmoe.model.spec dmoe_layer_spec
    --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" --expert-model-parallel-size "$ep"
    # the whole weights drawn on the CPU from the seed, then split: the same model at any TP size
    --use-cpu-initialization
    # no apex, no Transformer Engine
    --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-per-layer-logging
    # 4 micro-batches per step: the aux-loss gradient is scaled by megatron's schedule
    --micro-batch-size 4 --global-batch-size 16
    --train-iters "$iters" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 5 --lr-decay-style cosine
    --bf16 --seed 1234
    # every iteration's loss, to compare runs iteration by iteration
    --log-interval 1 --eval-interval 20 --eval-iters 1
    --tensorboard-dir "$work/tensorboard_$layout"
)
if [[ $sp == 1 ]]; then args+=(--sequence-parallel); fi
echo "megatron_lm_check: training $iters iterations at $layout on $nproc process(es); log in $log"
export CUDA_DEVICE_MAX_CONNECTIONS=1
set +e
"$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" "$work/stage/pretrain_gpt.py" \
    "${args[@]}" > "$log" 2>&1
status=$?
set -e
if [[ $status -ne 0 ]]; then
    tail -n 30 "$log" >&2
    echo "megatron_lm_check: FAIL: pretrain_gpt.py exited with $status (log: $log)" >&2
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
