#!/usr/bin/env bash
# The whole test suite on one H200 with Transformer Engine at the end of the session (the review fixes of
# init_empty_weights and NVIDIA.s fields, FASTA line numbers, the import-parity test). From the repository
# root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_review_fixes_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
timeout 420 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -14 "$OUT/suite.log"
