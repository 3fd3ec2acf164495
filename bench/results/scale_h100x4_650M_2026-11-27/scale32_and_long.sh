#!/bin/bash
# 4 x H100: weak scaling of 650M at 32k tokens per GPU, then context parallelism on 32k- and 64k-token proteins.
# From the repository root:
#   source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
#   bash bench/results/scale_h100x4_650M_2026-11-27/scale32_and_long.sh
set -u
start=$(date +%s)
timeout 250 python bench/recipe_checks.py scale --shape 650M --budgets 32768 --steps 50 --gpus 4 \
    --layouts replicate --out /tmp/scale32 > $OUT/scale32.log 2>&1
echo "scale32 rc=$? $(( $(date +%s) - start )) s"
timeout $(( 570 - ($(date +%s) - start) )) python bench/recipe_checks.py long --shape 650M --lengths 32768 65536 \
    --cps 2 4 --steps 16 --out /tmp/long > $OUT/long.log 2>&1
echo "long rc=$? $(( $(date +%s) - start )) s"
cp /tmp/scale32/*.json /tmp/long/*.json $OUT/ 2>/dev/null
for f in /tmp/scale32/*.log /tmp/long/*.log; do tail -n 3 $f > $OUT/tail_$(basename $f); done
