#!/bin/bash
# 4 x H100, after the fixes of the failures in suite_and_scale16.log: the GPU tests that failed there (and their files), a repeat of
# 650M at 16k tokens per GPU (1 GPU vs 4 replicated), and TE context parallelism's logits per mode and lengths
# (bench/cp_modes.py) with TE's default attention backend and with each of flash / fused forced.
# From the repository root:
#   source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
#   bash bench/results/scale_h100x4_650M_2026-11-27/retest_cp_modes_repeat.sh
set -u
start=$(date +%s)
mkdir -p $OUT/r
timeout 200 python -m pytest -q -rfEs -n 12 -p no:cacheprovider tests/test_gpu_graphs.py tests/test_readme.py \
    tests/test_user_messages.py tests/test_validation.py tests/test_gpu.py -k "not fp8_weights" > $OUT/r/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; tail -n 12 $OUT/r/tests.log
for backend in default NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=0; do
  env $( [ $backend = default ] || echo $backend ) PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 90 \
    python -m torch.distributed.run --nproc-per-node 2 --standalone bench/cp_modes.py --out $OUT/r/cp_modes_${backend%%=*}.json \
    > $OUT/r/cp_modes_${backend%%=*}.log 2>&1
  echo "cp_modes $backend rc=$? $(( $(date +%s) - start )) s"; cat $OUT/r/cp_modes_${backend%%=*}.json 2>/dev/null | tr -d '\n'; echo
done
timeout $(( 420 - ($(date +%s) - start) )) python bench/recipe_checks.py scale --shape 650M --budgets 16384 --steps 50 \
    --gpus 4 --layouts replicate --out /tmp/scale16r > $OUT/r/scale16_repeat.log 2>&1
echo "scale16 repeat rc=$? $(( $(date +%s) - start )) s"
cp /tmp/scale16r/*.json $OUT/r/ 2>/dev/null
for f in /tmp/scale16r/*.log; do tail -n 3 $f > $OUT/r/tail_$(basename $f); done
cd $OUT && tar czf retest_cp_modes_repeat.tgz r && rm -rf r
