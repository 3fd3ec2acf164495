#!/bin/bash
# H100: the recipe tests (the rest of the GPU suite), then the 650M speed table (README).
set -u
CALL_START=$(date +%s)
start=$(date +%s)
timeout 260 python -m pytest -q -rfEs -n 8 -p no:cacheprovider --durations=8 tests/test_recipe_*.py > $OUT/suite_part2.log 2>&1
echo "suite part 2 rc=$? $(( $(date +%s) - start )) s"; tail -n 6 $OUT/suite_part2.log
pkill -f pytest; sleep 2
start=$(date +%s)
timeout $(( 590 - start + CALL_START )) python bench/benchmark.py --shapes 650M --proteins 16 64 --steps 8 --warmup 3 \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 nv_thd transformers --out $OUT/bench650M > $OUT/bench650M.log 2>&1
echo "benchmark rc=$? $(( $(date +%s) - start )) s"; cut -c1-220 $OUT/bench650M.log | tail -n 24
