#!/bin/bash
# usage: ORDER="old new old new" bash .gpu/bench_alt.sh VARIANT PROTEINS... ; alternating trees, run k -> $OUT/k_tree.log
set -u
ROOT=$PWD
export OMP_NUM_THREADS=1
variant=$1; shift
k=0
for tree in $ORDER; do
  k=$((k+1))
  dir=$ROOT; [ $tree = old ] && dir=$ROOT/.gpu/old
  start=$(date +%s)
  (cd $dir && PYTHONPATH=$dir:$dir/bench:$PYTHONPATH python bench/benchmark.py --shapes 650M --proteins "$@" \
     --variants $variant --steps ${STEPS:-30} --warmup 3 --out /tmp/bench_$k > $OUT/${k}_${tree}.log 2>&1)
  echo "$k $tree rc=$? $(( $(date +%s) - start )) s"
done
