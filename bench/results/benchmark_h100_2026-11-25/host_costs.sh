#!/bin/bash
# H100: the graphed 650M inference step's host work at 64 proteins, piece by piece (the
# graph checks' module walk now without nn.Module.modules()), with cProfile; checked and unchecked.
set -u
start=$(date +%s)
timeout 240 python bench/host_gap.py --shape 650M --proteins 64 --modes infer --host-costs \
  --variants nv_thd_graphs_unchecked nv_thd_graphs --out $OUT/gap > $OUT/gap.log 2>&1
echo "host_gap rc=$? $(( $(date +%s) - start )) s"; grep "step ms" $OUT/gap.log; tail -3 $OUT/gap.log
