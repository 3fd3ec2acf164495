#!/usr/bin/env bash
# After the review fixes (75ab222, 1fb84d0: run options checked when the model is built, the trainer's WholeBar):
# the GPU tests of FP8 weights, offloading, validation, the graph conditions and the trainer's GPU runs. From the
# repository root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_review_fixes_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 200 python -m pytest -q -n 8 -rfEs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_graphs.py \
  -k "fp8_weights or offload or validation or stay_off or recipe" > "$OUT/subset.log" 2>&1
echo "exit $?" >> "$OUT/subset.log"; tail -6 "$OUT/subset.log"
