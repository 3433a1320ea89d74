#!/usr/bin/env bash
# Call 1: the floors of a fresh process on this machine, the engine's start-up with transformers 5.17 (the
# machine's) and 5.24, and a Ray replica's timeline on 2,048 rows with each.
L=$OUT/call1_log.txt
exec > >(tee -a $L) 2>&1
set -x
nvidia-smi -L; nproc
env | grep -E "^PYTHON|^CUDA|^TRITON|^TORCH" 
python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, sys.version)"
TD=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
echo "torch py: $(find $TD -name '*.py' | wc -l) pyc: $(find $TD -name '*.pyc' | wc -l)"
SP=$(dirname $TD); for p in transformers sympy sklearn scipy triton; do echo "$p py: $(find $SP/$p -name '*.py' | wc -l) pyc: $(find $SP/$p -name '*.pyc' | wc -l)"; done
mkdir -p /tmp/site /tmp/tf524
tar -xJf .device/ray/ray_site.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/ray/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf524 .device/tf524/*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 120 python3 -c "from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint as r; r('/tmp/q06')"
t() { local s=$(date +%s%N); timeout 120 "$@" > /dev/null 2>&1; local rc=$?; echo "FLOOR $(( ($(date +%s%N) - s) / 1000000 )) ms rc=$rc: ${*: -1}"; }
for i in 1 2; do
  t python3 -c "pass"
  t python3 -c "import torch"
  t python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
  t python3 -c "import torch, transformers"
  t python3 -c "import torch; from transformers import AutoConfig; AutoConfig.from_pretrained('/tmp/q06')"
  PYTHONPATH=/tmp/tf524:$PYTHONPATH t python3 -c "import torch; from transformers import AutoConfig, AutoTokenizer; AutoConfig.from_pretrained('/tmp/q06'); AutoTokenizer.from_pretrained('/tmp/q06')"
  t python3 -c "import torch; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('/tmp/q06')"
  t python3 -c "import ray"
  t python3 -c "import torch, triton"
  t python3 -c "import torch, flash_attn"
  t python3 -c "import torch, flash_attn_2_cuda"
done
PYTHONPATH=/tmp/tf524:$PYTHONPATH python3 -c "import transformers; print('tf', transformers.__version__)"
for i in 1 2; do
  timeout 120 python3 -m benchmarks.startup --random-checkpoint /tmp/q06
  PYTHONPATH=/tmp/tf524:$PYTHONPATH timeout 120 python3 -m benchmarks.startup --random-checkpoint /tmp/q06
done
PYTHONPATH=/tmp/tf524:$PYTHONPATH timeout 120 python3 -m benchmarks.startup --random-checkpoint /tmp/q06 --profile $OUT/call1_startup_profile_tf524.txt
mkdir -p $OUT/d517 $OUT/d524
timeout 200 python3 -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 --rows 2048 --batch-sizes 256 --paths ray --no-fresh-process --out $OUT/d517 2>&1 | grep -v "WARNING\|core_worker"
PYTHONPATH=/tmp/tf524:$PYTHONPATH timeout 200 python3 -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 --rows 2048 --batch-sizes 256 --paths ray --no-fresh-process --out $OUT/d524 2>&1 | grep -v "WARNING\|core_worker"
