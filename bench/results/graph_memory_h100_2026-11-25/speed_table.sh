#!/bin/bash
# H100: the 650M speed table from one run (plain TE port, ours graphs /
# graphs FP8 / eager), nothing else on the GPU.
set -u
start=$(date +%s)
timeout 285 python bench/benchmark.py --shapes 650M --proteins 16 64 --steps 8 --warmup 3 \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 nv_thd --out $OUT/bench650M > $OUT/bench650M.log 2>&1
echo "benchmark rc=$? $(( $(date +%s) - start )) s"
grep "^{" $OUT/bench650M.log | cut -c1-150
