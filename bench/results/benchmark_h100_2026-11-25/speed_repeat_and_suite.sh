#!/bin/bash
# H100: the 650M speed table from one run (plain TE port, ours eager / graphs /
# FP8 graphs, transformers) with the graph decision taken before the input checks' sync, then the GPU suite without
# the recipe tests (-n 12).
set -u
CALL_START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
timeout 330 python bench/benchmark.py --shapes 650M --proteins 16 64 --steps 8 --warmup 3 \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 nv_thd transformers --out $OUT/bench650M > $OUT/bench650M.log 2>&1
echo "benchmark rc=$? $(( $(date +%s) - start )) s"; grep "^{" $OUT/bench650M.log | cut -c1-190
pkill -f benchmark.py; sleep 2
start=$(date +%s)
tests=$(ls tests/test_*.py | grep -v test_recipe_)
timeout $(( 592 - start + CALL_START )) python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=8 $tests > $OUT/suite_part1.log 2>&1
echo "suite part 1 rc=$? $(( $(date +%s) - start )) s"; tail -n 25 $OUT/suite_part1.log
