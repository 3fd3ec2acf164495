#!/bin/bash
# H100 (the machine of speed_repeat_and_suite/): the 650M speed table again from one run (that one was cut by
# its timeout in the transformers variant before it wrote its JSON): plain TE port, ours graphs / FP8 graphs / eager.
set -u
start=$(date +%s)
timeout 300 python bench/benchmark.py --shapes 650M --proteins 16 64 --steps 8 --warmup 3 \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 nv_thd --out $OUT/bench650M > $OUT/bench650M.log 2>&1
echo "benchmark rc=$? $(( $(date +%s) - start )) s"; grep "^{" $OUT/bench650M.log | cut -c1-180
