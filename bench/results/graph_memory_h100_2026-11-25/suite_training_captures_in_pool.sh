#!/bin/bash
# H100: the GPU suite without the recipe tests on the training-only warm-up routing, then the
# 650M speed table (README) from one run: plain TE port, ours eager / graphs / graphs FP8, transformers.
set -u
CALL_START=$(date +%s)
tests=$(ls tests/test_*.py | grep -v test_recipe_)
timeout 235 python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=3 $tests > $OUT/suite_part1.log 2>&1
echo "suite part 1 rc=$? $(( $(date +%s) - CALL_START )) s"; tail -n 6 $OUT/suite_part1.log
pkill -f pytest; sleep 2
start=$(date +%s)
timeout $(( 592 - start + CALL_START )) python bench/benchmark.py --shapes 650M --proteins 16 64 --steps 8 --warmup 3 \
  --variants te_port nv_thd nv_thd_graphs nv_thd_graphs_fp8 transformers --out $OUT/bench650M > $OUT/bench650M.log 2>&1
echo "benchmark rc=$? $(( $(date +%s) - start )) s"
python - $OUT/bench650M.log <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    print(r["variant"], r["proteins"], r["mode"], round(r.get("tokens_per_second", 0)), "oom" if r.get("oom") else "")
PY
