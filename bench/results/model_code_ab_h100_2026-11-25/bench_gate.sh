#!/bin/bash
# usage: bash .gpu/bench_gate.sh VARIANT... ; runs bench/benchmark.py (650M, 16/64 proteins, train+infer) for the old
# tree (.gpu/old, the commit before) and the new tree, interleaved per variant, results under $OUT/{old,new}_VARIANT
set -u
ROOT=$PWD
export OMP_NUM_THREADS=1
for variant in "$@"; do
  for tree in ${ORDER:-old new}; do
    dir=$ROOT; [ $tree = old ] && dir=$ROOT/.gpu/old
    start=$(date +%s)
    (cd $dir && PYTHONPATH=$dir:$dir/bench:$PYTHONPATH python bench/benchmark.py --shapes 650M --proteins 16 64 \
       --variants $variant --steps ${STEPS:-8} --warmup 3 --out $OUT/${tree}_${variant} > $OUT/${tree}_${variant}.log 2>&1)
    echo "$tree $variant rc=$? $(( $(date +%s) - start )) s"
  done
done
