#!/usr/bin/env bash
# Train with Megatron-LM's own pretrain_gpt.py and this repository's MoE layer spec on one GPU, and
# check that the loss falls and that the aux losses appear in Megatron-LM's log.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/megatron_lm_check.sh MEGATRON_LM_DIR [WHEEL_DIR]

Runs Megatron-LM's pretrain_gpt.py (a checkout of tag core_v0.16.1 or core_v0.19.0 at
MEGATRON_LM_DIR) on one GPU with `--spec megatron_dmoe.model.spec dmoe_layer_spec`, mock data and
Megatron-LM's NullTokenizer, for a few dozen iterations, then checks Megatron-LM's log:
  - the `lm loss` of the last logged iteration is below 90 % of the first one;
  - `load_balancing_loss` (written by our layer into megatron-core's aux-loss tracker) is logged
    with a positive value.
Exits 0 when both hold, 1 otherwise, 2 on a setup problem. Nothing is downloaded.

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
  WORK_DIR    work folder: staged imports, log, TensorBoard events (default /tmp/megatron_lm_check)
  TRAIN_ITERS iterations (default 40)
  PYTHON      python interpreter (default python3)
  CUDA_VISIBLE_DEVICES  the GPU to use (default: the first)
EOF
}

if [[ $# -ge 1 && ( $1 == -h || $1 == --help ) ]]; then usage; exit 0; fi
if [[ $# -lt 1 || $# -gt 2 ]]; then usage >&2; exit 2; fi

fail_setup() { echo "megatron_lm_check: error: $*" >&2; exit 2; }

mlm=$(cd "$1" 2>/dev/null && pwd) || fail_setup "MEGATRON_LM_DIR '$1' is not a folder"
wheels=${2:-}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${WORK_DIR:-/tmp/megatron_lm_check}
iters=${TRAIN_ITERS:-40}
python=${PYTHON:-python3}

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
log=$work/train.log
args=(
    --spec megatron_dmoe.model.spec dmoe_layer_spec
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
    --log-interval 5 --eval-interval 20 --eval-iters 1
    --tensorboard-dir "$work/tensorboard"
)
echo "megatron_lm_check: training $iters iterations; log in $log"
export CUDA_DEVICE_MAX_CONNECTIONS=1
set +e
"$python" -m torch.distributed.run --standalone --nproc_per_node 1 "$work/stage/pretrain_gpt.py" "${args[@]}" \
    > "$log" 2>&1
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
exit $ok
