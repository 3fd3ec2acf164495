#!/usr/bin/env bash
# Call 2: the whole test suite on one H200 with Transformer Engine. From the repository root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_in_process_h200_2026-11-29/call_2.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 290 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -25 "$OUT/suite.log"
