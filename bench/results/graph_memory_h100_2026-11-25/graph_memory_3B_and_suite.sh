#!/bin/bash
# H100: the 3B graph-memory experiment, then the GPU suite without the recipe tests.
# Run as: source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1; bash bench/results/graph_memory_h100_2026-11-25/graph_memory_3B_and_suite.sh
set -u
CALL_START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
timeout 250 python bench/graph_memory.py --shape 3B --proteins 16 --steps 6 \
  --cases buckets_warmup_in_pool eager buckets_warmup_in_pool_fp8 --out $OUT/gm > $OUT/gm.log 2>&1
echo "graph_memory rc=$? $(( $(date +%s) - start )) s"; tail -n 12 $OUT/gm.log
pkill -f graph_memory.py; sleep 2
start=$(date +%s)
tests=$(ls tests/test_*.py | grep -v test_recipe_)
timeout $(( 585 - start + CALL_START )) python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=8 $tests > $OUT/suite_part1.log 2>&1
echo "suite part 1 rc=$? $(( $(date +%s) - start )) s"; tail -n 14 $OUT/suite_part1.log
