#!/usr/bin/env bash
# The whole test suite on one H200 with Transformer Engine after quantized init on the meta device (issue 64, part
# 2), the tensor-parallel split moved beside its plan and the converter's review (issue 63). From the repository
# root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_quantized_init_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
timeout 420 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -14 "$OUT/suite.log"
