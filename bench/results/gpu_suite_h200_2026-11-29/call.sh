#!/usr/bin/env bash
# The whole test suite on one H200 with Transformer Engine, from the repository root, .gpu/ carried, OUT a folder:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 275 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -25 "$OUT/suite.log"
