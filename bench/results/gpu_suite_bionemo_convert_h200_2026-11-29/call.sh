#!/usr/bin/env bash
# The whole test suite on one H200 with Transformer Engine at the BioNeMo converter (issue 64, part 1) and the
# torch-free `nv-esm convert --help`. From the repository root, .gpu/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_bionemo_convert_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 400 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -12 "$OUT/suite.log"
