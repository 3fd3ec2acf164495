#!/usr/bin/env bash
# Call 1: the whole test suite on one H200 with Transformer Engine, at the forward-plan change (issue 63, part) with
# issue 62's rest. From the repository root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_speed_forward_plan_h200_2026-11-29/call_1.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 400 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -30 "$OUT/suite.log"
