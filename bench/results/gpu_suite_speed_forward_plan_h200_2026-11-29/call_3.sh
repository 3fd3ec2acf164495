#!/usr/bin/env bash
# Call 3: the whole test suite again, after the run options were set apart from the architecture (RunOptions) and
# the bench/ clean-up. From the repository root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_speed_forward_plan_h200_2026-11-29/call_3.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 400 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -30 "$OUT/suite.log"
