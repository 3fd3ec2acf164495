#!/bin/bash
# H100, tree e8c860e: 3B training at 16 proteins against the
# plain TE port (eager, graphs, FP8 graphs), then per-kernel-kind traces of 650M at 64 proteins (port, graphs,
# FP8 graphs; train and infer). Nothing else on the GPU.
# Run as: source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1; bash bench/results/benchmark_h100_2026-11-25/train_3B_and_profile.sh
set -u
CALL_START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
start=$(date +%s)
timeout 330 python bench/benchmark.py --shapes 3B --proteins 16 --modes train --steps 8 --warmup 3 \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 nv_thd --out $OUT/bench3B > $OUT/bench3B.log 2>&1
echo "benchmark 3B rc=$? $(( $(date +%s) - start )) s"; grep "^{" $OUT/bench3B.log | cut -c1-220
pkill -f benchmark.py; sleep 2
start=$(date +%s)
timeout $(( 590 - start + CALL_START )) python bench/profile_step.py --shape 650M --proteins 64 --modes train infer \
  --variants te_port nv_thd_graphs nv_thd_graphs_fp8 --trace-steps 3 --out $OUT/profile --trace-dir /tmp/traces \
  > $OUT/profile.log 2>&1
echo "profile rc=$? $(( $(date +%s) - start )) s"; grep "ms/step" $OUT/profile.log
