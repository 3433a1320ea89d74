#!/usr/bin/env bash
# Call 3: the GPU tests in full (a failure of call 2 looked at), start-up phases of this tree against main's.
L=$OUT/call3_log.txt
exec > >(tee -a $L) 2>&1
mkdir -p /tmp/tf524
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf524 .device/tf524/*.whl
T5=/tmp/tf524:$PYTHONPATH
MAIN=$PWD/.device/main_tree:$PYTHONPATH
timeout 120 python3 -c "from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint as r; r('/tmp/q06')"
echo "== tests"
PYTHONPATH=$T5 timeout 200 python3 -m pytest -q -s tests/test_gpu.py tests/test_imports.py > $OUT/call3_tests.txt 2>&1; echo "tests rc=$?"
tail -5 $OUT/call3_tests.txt
if grep -q "FAILED tests/test_gpu.py::test_engines_one_after_another" $OUT/call3_tests.txt; then
  PYTHONPATH=$PWD/.device/tree_oldcapture:$T5 timeout 100 python3 -m pytest -q -s tests/test_gpu.py -k engines_one_after_another > $OUT/call3_test_oldcapture.txt 2>&1; echo "old capture rc=$?"; tail -3 $OUT/call3_test_oldcapture.txt
fi
st() { echo "STARTUP $1"; PYTHONPATH=$2 timeout 100 python3 -m benchmarks.startup --random-checkpoint /tmp/q06 | tail -1; }
echo "== as the machine comes"
st "new tf517" $PYTHONPATH; st "main tf517" $MAIN; st "new tf524" $T5; st "main tf524" /tmp/tf524:$MAIN
echo "== bytecode compiled"
SP=/opt/torch/.venv/lib/python3.12/site-packages
s=$(date +%s); timeout 200 python3 -m compileall -q -j 16 $SP /tmp/tf524 > /dev/null 2>&1; echo "compileall rc=$? $(( $(date +%s) - s )) s"
st "new tf524" $T5; st "main tf524" /tmp/tf524:$MAIN; st "new tf517" $PYTHONPATH
