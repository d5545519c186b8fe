python3 -m pip install -q --no-deps --no-index .whl/*.whl >/dev/null 2>&1; mkdir -p /tmp/site && ln -sfn $PWD/kernels /tmp/site/dmoe_kernels && ln -sfn $PWD/configs /tmp/site/megatron_dmoe_configs && export PYTHONPATH=$PWD:/tmp/site
timeout 250 python -m pytest -q -m gpu tests/kernels tests/moe tests/model tests/training -p no:cacheprovider 2>&1 | tail -2
cd tools
timeout 300 python bench_train.py --cuda-graphs both --steps 8 --out $OUT/train_final3.json > $OUT/train_final3.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/train_final3.txt | tail -10
