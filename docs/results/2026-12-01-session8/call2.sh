#!/usr/bin/env bash
# Call 2: GPU tests of the change; start-up of this tree against main's (a copy in .device/main_tree), with
# transformers 5.17 (the machine's) and 5.24, first as the machine comes (torch, sympy, triton without
# bytecode), then with bytecode compiled as a pip install writes it; a replica's timeline at 2,048 rows.
L=$OUT/call2_log.txt
exec > >(tee -a $L) 2>&1
mkdir -p /tmp/site /tmp/tf524
tar -xJf .device/ray/ray_site.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/ray/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf524 .device/tf524/*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
T5=/tmp/tf524:$PYTHONPATH
MAIN=$PWD/.device/main_tree:$PYTHONPATH
timeout 120 python3 -c "from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint as r; r('/tmp/q06')"
echo "== tests"
PYTHONPATH=$T5 timeout 150 python3 -m pytest -q -x tests/test_gpu.py tests/test_imports.py 2>&1 | tail -4
st() { echo "STARTUP $1"; PYTHONPATH=$2 timeout 100 python3 -m benchmarks.startup --random-checkpoint /tmp/q06 | tail -1; }
echo "== as the machine comes"
st "new tf517" $PYTHONPATH; st "main tf517" $MAIN; st "new tf524" $T5; st "main tf524" /tmp/tf524:$MAIN
mkdir -p $OUT/r1 $OUT/r2
PYTHONPATH=$T5 timeout 150 python3 -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 --rows 2048 --batch-sizes 256 --paths ray --no-fresh-process --out $OUT/r1 2>&1 | grep "^{"
echo "== bytecode compiled"
SP=/opt/torch/.venv/lib/python3.12/site-packages
s=$(date +%s); timeout 200 python3 -m compileall -q -j 16 $SP /tmp/site /tmp/tf524 > /dev/null 2>&1; echo "compileall rc=$? $(( $(date +%s) - s )) s"
st "new tf524" $T5; st "main tf524" /tmp/tf524:$MAIN
PYTHONPATH=$T5 timeout 150 python3 -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 --rows 2048 --batch-sizes 256 --paths ray,run_batch --no-fresh-process --out $OUT/r2 2>&1 | grep "^{\|^run_batch\|served"
