#!/usr/bin/env bash
# Call 4: the GPU tests after the capture stream fix; start-up of this tree against main's, alternating, in the
# same call (bytecode compiled, transformers 5.24); a replica at 2,048 rows and run_batch at 4,096 lines.
L=$OUT/call4_log.txt
exec > >(tee -a $L) 2>&1
mkdir -p /tmp/site /tmp/tf524
tar -xJf .device/ray/ray_site.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/ray/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf524 .device/tf524/*.whl
T5=/tmp/tf524:/tmp/site:$PYTHONPATH
timeout 120 python3 -c "from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint as r; r('/tmp/q06')"
echo "== tests"
PYTHONPATH=$T5 timeout 200 python3 -m pytest -q -s tests/test_gpu.py tests/test_imports.py > $OUT/call4_tests.txt 2>&1; echo "tests rc=$?"
tail -4 $OUT/call4_tests.txt
SP=/opt/torch/.venv/lib/python3.12/site-packages
s=$(date +%s); timeout 100 python3 -m compileall -q -j 16 $SP /tmp/tf524 /tmp/site > /dev/null 2>&1; echo "compileall rc=$? $(( $(date +%s) - s )) s"
st() { echo "STARTUP $1"; (cd $2 && PYTHONPATH=$T5 timeout 60 python3 -m benchmarks.startup --random-checkpoint /tmp/q06 | tail -1); }
for i in 1 2; do st new $PWD; st main $PWD/.device/main_tree; done
mkdir -p $OUT/r
PYTHONPATH=$T5 timeout 200 python3 -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 --rows 2048 --batch-sizes 256 --paths ray,run_batch --no-fresh-process --out $OUT/r 2>&1 | grep "^{\|^run_batch\|served\|^|"
